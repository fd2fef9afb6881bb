"""The error every treepack Python API raises."""

from __future__ import annotations

import json


class TreepackError(ValueError):
    """Same codes and location as the TypeScript TreepackError: ``code`` (E_INPUT, E_IO, ...), ``file``, ``field``;
    ``reason`` is the message without the location."""

    def __init__(self, code: str, message: str, file: str | None = None, field: str | None = None):
        where = [w for w in (file, None if field is None else f"field {json.dumps(field)}") if w is not None]
        super().__init__((", ".join(where) + ": " if where else "") + message)
        self.code = code
        self.reason = message
        self.file = file
        self.field = field

"""A trainer's rows ↔ a packed batch: the converters of a trainer adapter (rows → forest → forward → rows).

Trainers hand their forward padded rows ``[B, T]`` whose last ``R`` columns are the response (TRL, OpenRLHF,
SkyRL, legacy verl: left-padded prompt, right-padded response) or jagged rows (current verl), and want
``[B, R]`` (or jagged) logprobs back. ``from_padded`` / ``from_jagged`` pack the rows into one forest, a row's
scoring starting at its first response token; ``RowLayout`` puts per-node or per-occurrence values back where the
trainer wants them, with a finite fill: ``packed_logprobs`` returns NaN at unscored nodes, and ``NaN × 0`` poisons
every masked sum. ``padded_rows`` goes the other way, a stored ``PackedBatch`` as padded rows.

    >>> import torch
    >>> from transformers import AutoModelForCausalLM
    >>> from treepack.torch import forward_logprobs, from_padded
    >>> model = AutoModelForCausalLM.from_pretrained("tiny-model", attn_implementation="treepack")
    >>> input_ids = torch.tensor([[0, 0, 2, 3, 6, 7, 1], [2, 3, 4, 5, 8, 9, 1]])   # TRL's rows: prompt, completion
    >>> attention_mask = (input_ids != 0).long()                # 0 at the left padding
    >>> completion_mask = torch.tensor([[1, 1, 1], [1, 0, 1]])  # R = 3; row 1's middle token a tool's: not trained
    >>> batch, layout = from_padded(input_ids, attention_mask, response_mask=completion_mask)
    >>> scores = forward_logprobs(model, batch)                  # [N], NaN where not scored
    >>> per_token = layout.to_padded(scores.logprobs, fill=0.0)  # [B, R], 0 where not trainable
    >>> per_token[1, 1].item()
    0.0
    >>> plain = AutoModelForCausalLM.from_pretrained("tiny-model")   # stock attention: row 0 alone, unpadded
    >>> row = input_ids[0, 2:]
    >>> reference = plain(row[None]).logits[0, :-1].log_softmax(-1).gather(-1, row[1:, None])[-3:, 0]
    >>> torch.allclose(per_token[0], reference, atol=1e-5)
    True

Response tokens with mask 0 (tool results, environment feedback) stay in the tree (later tokens attend to them)
but are not trainable, so not scored; so are attended columns the attention mask drops (a sequence is the row's
attended tokens in order, at positions 0, 1, …).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import torch

from ..microbatch import TreepackError
from ..pack import pack_sequences
from .batch import PackedBatch, from_microbatch

Jagged = Union[Sequence[torch.Tensor], tuple[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class RowLayout:
    """Where each occurrence of a packed batch sits in the trainer's output rows.

    ``flat`` [M]: the occurrence's index in the flattened output (-1 outside it, e.g. prompt tokens); the output is
    ``[rows, width]`` (padded) or jagged with ``offsets`` [rows + 1]."""

    batch: PackedBatch
    flat: torch.Tensor  # int64 [M]
    rows: int
    width: int | None = None
    offsets: torch.Tensor | None = None  # int64 [rows + 1], jagged outputs only

    def _scatter(self, values: torch.Tensor, fill: float, of: str, where: str) -> torch.Tensor:
        b = self.batch
        if of == "nodes":
            if values.shape[0] != b.num_nodes:
                raise TreepackError("E_ARG", f"expected {b.num_nodes} node values, got {values.shape[0]}", field="values")
            values = values.index_select(0, b.seq_positions.to(values.device))
        elif of != "occurrences":
            raise TreepackError("E_ARG", f"expected 'nodes' or 'occurrences', got {of!r}", field="of")
        elif values.shape[0] != b.num_occurrences:
            raise TreepackError("E_ARG", f"expected {b.num_occurrences} occurrence values, got {values.shape[0]}", field="values")
        if where == "trainable":
            keep = (self.flat >= 0) & b.loss_mask
        elif where == "all":
            keep = self.flat >= 0
        else:
            raise TreepackError("E_ARG", f"expected 'trainable' or 'all', got {where!r}", field="where")
        keep = keep.to(values.device)
        if self.offsets is not None:
            size = int(self.offsets[-1])
        elif self.width is not None:
            size = self.rows * self.width
        else:
            raise TreepackError("E_ARG", "a RowLayout has a width (padded rows) or offsets (jagged rows)", field="width")
        out = values.new_full((size,), fill)
        # index_put (not in-place) so autograd reaches the values; trainable slots get every value, NaN included.
        return out.index_put((self.flat.to(values.device)[keep],), values[keep])

    def to_padded(self, values: torch.Tensor, fill: float = 0.0, of: str = "nodes", where: str = "trainable") -> torch.Tensor:
        """``[rows, width]`` from node values [N] (``of="nodes"``, what the forwards return) or occurrence values [M]
        (``of="occurrences"``, a PackedBatch's floats); slots of non-trainable occurrences (``where="all"``: of
        none) and padding get ``fill``. Differentiable in ``values``."""
        if self.width is None:
            raise TreepackError("E_ARG", "this layout is jagged: use to_jagged", field="layout")
        return self._scatter(values, fill, of, where).view(self.rows, self.width)

    def to_jagged(
        self, values: torch.Tensor, fill: float = 0.0, of: str = "nodes", where: str = "trainable"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, offsets)``: row i's outputs at ``values[offsets[i]:offsets[i+1]]``
        (``torch.nested.nested_tensor_from_jagged(values, offsets)`` makes it a nested tensor)."""
        if self.offsets is None:
            raise TreepackError("E_ARG", "this layout is padded: use to_padded", field="layout")
        return self._scatter(values, fill, of, where), self.offsets


def _pack(seqs: list[torch.Tensor], score_from: list[int], trainable: list[torch.Tensor], device: torch.device) -> PackedBatch:
    """The forest of ``seqs`` with loss_mask = ``trainable[i]`` on tokens ``score_from[i]`` onward, 0 before."""
    mb = pack_sequences([s.tolist() for s in seqs])
    batch = from_microbatch(mb, device, check=False)  # the C core's packer builds valid forests
    mask = torch.zeros(batch.num_occurrences, dtype=torch.bool, device=device)
    for i, (s, m) in enumerate(zip(score_from, trainable)):
        a = int(batch.seq_offsets[i])
        mask[a + s : a + s + m.shape[0]] = m.to(device, torch.bool)
    first = batch.seq_offsets[:-1][batch.seq_offsets[:-1] < batch.seq_offsets[1:]]
    if bool(mask[first].any()):
        row = int(batch.seq_index[first[mask[first]][0]])
        raise TreepackError(
            "E_INPUT", f"row {row}: its first token is trainable, but no token precedes it to predict it", field="response_mask"
        )
    batch.loss_mask = mask
    return batch


def from_padded(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor | None = None,
    response_length: int | None = None,
) -> tuple[PackedBatch, RowLayout]:
    """Padded rows ``[B, T]`` (0 in ``attention_mask`` at padding) whose last ``R`` columns are the response, as one
    packed batch and the layout of its ``[B, R]`` outputs. Give ``response_mask`` [B, R] (1 = trainable; tool
    tokens 0) or ``response_length`` R (every attended response token trainable).

        >>> import torch
        >>> ids = torch.tensor([[0, 5, 6, 7], [5, 6, 8, 9]])           # OpenRLHF's sequences: padded prompt, response
        >>> action_mask = torch.tensor([[1, 1], [1, 1]])               # R = 2: [6, 7] and [8, 9]
        >>> batch, layout = from_padded(ids, (ids != 0).long(), response_mask=action_mask)
        >>> batch.input_ids.tolist()                                   # the rows' forest: [5, 6] shared
        [5, 6, 7, 8, 9]
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise TreepackError(
            "E_ARG",
            f"expected input_ids and attention_mask of one shape [B, T], got {list(input_ids.shape)} and {list(attention_mask.shape)}",
            field="attention_mask",
        )
    B, T = input_ids.shape
    if (response_mask is None) == (response_length is None):
        raise TreepackError("E_ARG", "give response_mask or response_length, not both", field="response_mask")
    if response_mask is not None:
        if response_mask.dim() != 2 or response_mask.shape[0] != B or response_mask.shape[1] > T:
            raise TreepackError(
                "E_ARG", f"expected response_mask [B = {B}, R <= {T}], got {list(response_mask.shape)}", field="response_mask"
            )
        R = response_mask.shape[1]
    else:
        if not (isinstance(response_length, int) and 0 <= response_length <= T):
            raise TreepackError("E_ARG", f"expected an integer in [0, {T}], got {response_length!r}", field="response_length")
        R = response_length
    attended = attention_mask.bool()
    resp_attended = attended[:, T - R :]
    trainable = resp_attended if response_mask is None else resp_attended & response_mask.bool()
    seqs, score_from, train = [], [], []
    for i in range(B):
        seqs.append(input_ids[i][attended[i]])
        score_from.append(int(attended[i, : T - R].sum()))
        train.append(trainable[i][resp_attended[i]])
    batch = _pack(seqs, score_from, train, input_ids.device)
    # An occurrence's output column: its row's attended response columns, in order.
    cols = torch.arange(R, device=input_ids.device).expand(B, R)[resp_attended]
    occ = _response_occurrences(batch, score_from)
    flat = torch.full((batch.num_occurrences,), -1, dtype=torch.int64, device=input_ids.device)
    flat[occ] = batch.seq_index[occ] * R + cols
    return batch, RowLayout(batch, flat, B, width=R)


def _response_occurrences(batch: PackedBatch, score_from: list[int]) -> torch.Tensor:
    """Occurrences at or after each sequence's ``score_from``, ascending (sequence-major)."""
    start = torch.tensor(score_from, dtype=torch.int64, device=batch.device)
    return torch.nonzero(batch.token_index >= start[batch.seq_index]).flatten()


def _jagged_rows(x: Jagged, name: str) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor) and x.is_nested:
        return list(x.unbind())
    if isinstance(x, tuple) and len(x) == 2 and all(isinstance(t, torch.Tensor) for t in x):
        values, offsets = x
        return [values[int(a) : int(b)] for a, b in zip(offsets[:-1], offsets[1:])]
    if isinstance(x, (list, tuple)) and all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in x):
        return list(x)
    raise TreepackError("E_ARG", "expected a nested tensor, (values, offsets) or a list of 1-D tensors", field=name)


def from_jagged(
    input_ids: Jagged,
    response_start: Sequence[int] | torch.Tensor,
    response_mask: Jagged | None = None,
) -> tuple[PackedBatch, RowLayout]:
    """Jagged rows (a nested tensor, ``(values, offsets)`` or a list of 1-D tensors: prompt then response, no
    padding) as one packed batch and the jagged layout of the responses' outputs. ``response_start[i]``: the
    index of row i's first response token; ``response_mask``: jagged over the responses (1 = trainable), all
    trainable when None.

        >>> import torch
        >>> from transformers import AutoModelForCausalLM
        >>> from treepack.torch import forward_logprobs
        >>> model = AutoModelForCausalLM.from_pretrained("tiny-model", attn_implementation="treepack")
        >>> rows = [torch.tensor([5, 6, 7]), torch.tensor([5, 6, 8, 9])]   # verl-shaped rows: prompt, then response
        >>> batch, layout = from_jagged(rows, [1, 2], [torch.tensor([1, 1]), torch.tensor([0, 1])])   # 8 not trained
        >>> logprobs, offsets = layout.to_jagged(forward_logprobs(model, batch).logprobs)
        >>> offsets.tolist(), logprobs.shape, logprobs[2].item()      # the responses [6, 7] and [8, 9], 0 at 8
        ([0, 2, 4], torch.Size([4]), 0.0)
    """
    seqs = _jagged_rows(input_ids, "input_ids")
    starts = [int(s) for s in (response_start.tolist() if isinstance(response_start, torch.Tensor) else response_start)]
    if len(starts) != len(seqs) or any(not 0 <= s <= len(q) for s, q in zip(starts, seqs)):
        raise TreepackError("E_ARG", f"expected {len(seqs)} response starts, each within its row", field="response_start")
    lengths = [len(q) - s for s, q in zip(starts, seqs)]
    device = seqs[0].device if seqs else torch.device("cpu")
    if response_mask is None:
        train = [torch.ones(n, dtype=torch.bool, device=device) for n in lengths]
    else:
        train = _jagged_rows(response_mask, "response_mask")
        if [len(m) for m in train] != lengths:
            raise TreepackError(
                "E_ARG", f"expected response masks of lengths {lengths}, got {[len(m) for m in train]}", field="response_mask"
            )
    batch = _pack(seqs, starts, train, device)
    offsets = torch.tensor([0] + lengths, dtype=torch.int64, device=device).cumsum(0)
    occ = _response_occurrences(batch, starts)
    flat = torch.full((batch.num_occurrences,), -1, dtype=torch.int64, device=device)
    flat[occ] = offsets[batch.seq_index[occ]] + batch.token_index[occ] - torch.tensor(starts, device=device)[batch.seq_index[occ]]
    return batch, RowLayout(batch, flat, len(seqs), offsets=offsets)


def padded_rows(batch: PackedBatch, pad_token_id: int) -> tuple[dict[str, torch.Tensor], RowLayout]:
    """A packed batch as TRL-shaped padded rows: each sequence split at its first trainable token into a
    left-padded prompt and a right-padded response. Returns ``prompt_ids``, ``prompt_mask``, ``completion_ids``,
    ``completion_mask`` (1 on the response's tokens) and ``loss_mask`` ([B, R], the response's trainable tokens:
    its holes are tool tokens), and the ``[B, R]`` layout of the responses (``layout.to_padded(batch.advantages,
    of="occurrences", where="all")`` is the advantages).

        >>> import treepack
        >>> from treepack.torch import load_microbatch
        >>> rows, layout = padded_rows(load_microbatch(treepack.list_microbatches("packed")[1]), pad_token_id=0)
        >>> rows["prompt_ids"].tolist(), rows["completion_ids"].tolist()   # samples c and d, split at their masks
        ([[2, 3, 10], [2, 3, 10]], [[11, 12, 1], [13, 1, 0]])
    """
    S = batch.num_sequences
    lengths = (batch.seq_offsets[1:] - batch.seq_offsets[:-1]).tolist()
    starts = []
    for i in range(S):
        a, b = int(batch.seq_offsets[i]), int(batch.seq_offsets[i + 1])
        hit = torch.nonzero(batch.loss_mask[a:b]).flatten()
        starts.append(int(hit[0]) if hit.numel() else b - a)
    P = max(starts, default=0)
    R = max((n - s for n, s in zip(lengths, starts)), default=0)
    tokens = batch.input_ids[batch.seq_positions]
    dev = batch.device
    prompt_ids = torch.full((S, P), pad_token_id, dtype=torch.int64, device=dev)
    prompt_mask = torch.zeros((S, P), dtype=torch.int64, device=dev)
    completion_ids = torch.full((S, R), pad_token_id, dtype=torch.int64, device=dev)
    completion_mask = torch.zeros((S, R), dtype=torch.int64, device=dev)
    loss_mask = torch.zeros((S, R), dtype=torch.int64, device=dev)
    for i, (n, s) in enumerate(zip(lengths, starts)):
        a = int(batch.seq_offsets[i])
        prompt_ids[i, P - s :] = tokens[a : a + s]
        prompt_mask[i, P - s :] = 1
        completion_ids[i, : n - s] = tokens[a + s : a + n]
        completion_mask[i, : n - s] = 1
        loss_mask[i, : n - s] = batch.loss_mask[a + s : a + n]
    occ = _response_occurrences(batch, starts)
    flat = torch.full((batch.num_occurrences,), -1, dtype=torch.int64, device=dev)
    flat[occ] = batch.seq_index[occ] * R + batch.token_index[occ] - torch.tensor(starts, device=dev)[batch.seq_index[occ]]
    rows = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "loss_mask": loss_mask,
    }
    return rows, RowLayout(batch, flat, S, width=R)

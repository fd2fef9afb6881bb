"""The Hugging Face model inside a trainer's wrappers (DDP, FSDP1, DeepSpeed, PEFT): where its config and its
modules are read; the forward always goes through the outermost wrapper."""

from __future__ import annotations

import torch


def wrappers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model`` and every module inside its DDP / FSDP1 / DeepSpeed (``.module``) and PEFT (``get_base_model()``)
    wrappers, outermost first; the last is the Hugging Face model."""
    out = [model]
    while True:
        get_base_model = getattr(model, "get_base_model", None)  # PEFT's (torch types Module attributes as Tensor | Module)
        if get_base_model is not None:
            inner = get_base_model()
        elif isinstance(getattr(model, "module", None), torch.nn.Module):
            inner = model.module
        else:
            return out
        if inner is model:
            return out
        model = inner
        out.append(model)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside DDP / FSDP1 / DeepSpeed (``.module``) and PEFT (``get_base_model()``)
    wrappers, for reading its config; the forward always goes through the wrapper."""
    return wrappers(model)[-1]

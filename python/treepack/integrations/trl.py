"""TRL's ``GRPOTrainer``, packed: every forward of a step (policy, old, reference) runs on a forest of the rows'
distinct prefixes, each group's rows stay in one micro-batch, and TRL's loss code (loss types, KL, importance
sampling, entropy masks) runs unchanged on the ``[B, T]`` logprobs it always gets.

    >>> from datasets import Dataset
    >>> from transformers import AutoModelForCausalLM, AutoTokenizer
    >>> from trl import GRPOConfig
    >>> from treepack.integrations.trl import TreepackGRPOTrainer   # imports treepack.torch: registers "treepack"
    >>> model = AutoModelForCausalLM.from_pretrained("tiny-model", attn_implementation="treepack")
    >>> tok = AutoTokenizer.from_pretrained("tiny-model")
    >>> ds = Dataset.from_dict({"prompt": ["w2 w3 w4", "w2 w3 w5"]})
    >>> reward = lambda completions, **kwargs: [float(len(c)) for c in completions]
    >>> args = GRPOConfig(output_dir="grpo", per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
    ...                   max_steps=1, logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=True)
    >>> trainer = TreepackGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok)
    >>> trainer.train().global_step       # TRL prints its logs
    {...}
    1
    >>> trainer.state.log_history[0]["treepack/compression"] > 1   # naive / packed tokens: each prompt's 4 rows share it
    True

Or train on treepack's micro-batches (``treepack pack`` output or ``treepack serve``), each one TRL micro-batch,
its stored forest reused by the forward:

    >>> from treepack.torch import PackedDataset
    >>> args = GRPOConfig(output_dir="grpo", per_device_train_batch_size=2, num_generations=2, max_steps=1,
    ...                   logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=True)
    >>> trainer = TreepackGRPOTrainer(model=model, args=args, processing_class=tok,
    ...                               packed_batches=PackedDataset("packed/"))   # or FeedClient(url)
    >>> trainer.train().global_step
    {...}
    1
    >>> trainer.state.log_history[0]["treepack/compression"]       # packed/'s first micro-batch: 14 tokens in 10
    1.4

Micro-batches packed with a step plan (``treepack pack --prefix-reuse C``) train through the step-plan executor
(``treepack.torch.StepPlanRunner``): the policy's training forward computes only the nodes past the cached prefix,
and after TRL's backward the prefixes the plan releases are recomputed and back-propagated. Set
``gradient_accumulation_steps`` (and ``steps_per_generation``) so an optimizer step never falls while a prefix is
cached (a rank's micro-batches of one packing window per step). Under DDP each rank trains its own micro-batches
(``FeedClient(rank=...)``, or the directory's entries of its rank) and the gradients are averaged once per
optimizer step, after the last pops; FSDP and DeepSpeed are refused (the executor calls the layers itself).

With ``context_parallel=K`` (launched on a multiple of K processes, DDP), each packed row of the policy's training
forward is split over a context-parallel group of K consecutive ranks (docs/guides/context-parallel.md): a group
gathers its members' generated rows (stored micro-batches: every member is given the same ones) and trains them
together as one data-parallel rank, each member computing its local part of every row (keys/values exchanged),
TRL's loss run unchanged on every member on the whole row's scores (``treepack.torch.whole_row``), the gradients
summed over the group and averaged over the groups. (accelerate's ``ParallelismConfig(cp_size=...)`` does not fit:
TRL refuses it for GRPO, and its ring attention runs SDPA's causal mask, not a tree.)

A Qwen2.5-VL or Qwen3-VL's rows with images run as one forest whose images are their pixel values' identity
(``treepack.torch.vision.from_padded_images``; ``packed_logprobs`` on the model itself, so not inside a DDP/FSDP
wrapper): each distinct image of a chunk is encoded once, and the results are stock TRL's.

Each piece is a mixin over ``GRPOTrainer`` (``PackedForwardMixin``, ``GroupedBatchesMixin``), so a project with
its own GRPOTrainer subclass can take one of them.

The mixins override TRL's private methods and read its private state (``_step``, ``_buffered_inputs``,
``_metrics``, ...), which any TRL release may change: importing this module refuses a TRL or transformers outside
``treepack.versions.SUPPORTED`` (TreepackError E_BACKEND; ``TREEPACK_ALLOW_UNTESTED_VERSIONS=1`` runs it anyway).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ..microbatch import TreepackError
from ..plan import plan_micro_batches
from ..torch import (
    ContextParallel,
    NodeScores,
    PackedBatch,
    RowLayout,
    StepPlanRunner,
    forward_logprobs,
    from_padded,
    packed_logprobs,
    padded_rows,
    reduce_gradients,
    scored_nodes,
    split_batch,
    sync_gradients,
    whole_row,
)
from ..torch.moe import load_balancing_loss
from ..torch.vision import from_padded_images, vision_family
from ..torch.wrappers import unwrap
from ..versions import require

require("trl")
require("transformers")

# After the version check: an unknown TRL may not even have these.
from trl import GRPOTrainer  # noqa: E402
from trl.models.utils import disable_gradient_checkpointing  # noqa: E402
from trl.trainer.utils import use_adapter  # noqa: E402

# TRL's multimodal inputs the Qwen2-VL family's rows carry (mm_token_type_ids: recomputed from the image token).
_VISION_INPUTS = ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids")
# Those laid out per image, not per row: split with their rows by _take_images.
_IMAGE_TENSORS = ("pixel_values", "image_grid_thw", "num_images")


class PackedForwardMixin:
    """Overrides ``_get_per_token_logps_and_entropies``, the one method TRL's policy, old and reference forwards go
    through: the rows become one forest (scored from each row's first completion token), the wrapped model runs
    on it (``forward_logprobs``: DDP, FSDP and PEFT see their own forward; DeepSpeed is untested), and the logprobs and
    entropies come back as ``[B, logits_to_keep]``, 0 where the row has no attended token. With TRL's
    ``batch_size`` (old/reference forwards of a generation batch), rows are packed in chunks of whole groups.
    TRL's own generation (no vLLM, no ``rollout_func``) runs with SDPA attention.

    A stored micro-batch with a step plan (header ``prefix_tokens``) runs, in the policy's training forward,
    through one ``StepPlanRunner`` kept across micro-batches (pushes, then only the nodes past the cached prefix);
    ``training_step`` releases its prefixes after TRL's backward (and, under DDP, averages the gradients at the
    accumulation's last micro-batch). Under context parallelism (``treepack_cp_size`` > 1) the training forward runs
    this rank's local part and ``training_step`` sums the gradients over the group at the
    accumulation's last micro-batch, then averages them over the world. Old and reference forwards (no grad) run each
    micro-batch in full, which its file holds.

    With ``router_aux_loss_coef`` on and a MoE model, the router's load-balancing loss is computed on the forest with
    each node counted once per row that contains it (``treepack.torch.load_balancing_loss``): stock TRL's value; a
    step plan's micro-batch includes its cached prefix's router logits (``StepPlanRunner(router=True)``).

    ``treepack_stats``: (tokens, packed nodes) of the latest forwards (up to ``STATS_KEPT``), in order; each
    training forward also logs ``treepack/compression`` (tokens ÷ nodes) with TRL's metrics."""

    STATS_KEPT = 1024

    treepack_attention: str = "auto"
    # Context parallelism (TreepackGRPOTrainer(context_parallel=K)): K (1: off), this rank's CP group (None: the
    # default one) and the number of data-parallel groups (the world's ranks / K).
    treepack_cp_size: int = 1
    treepack_cp_group: Any = None
    treepack_dp_size: int = 1

    # Read from the GRPOTrainer the mixin is mixed into (declared for the type checker; no values here; Any where
    # TRL's own type differs between its versions).
    model: Any
    temperature: float
    _metrics: dict[str, Any]
    _entropy_bonus_enabled: bool

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, compute_aux_loss=False, **multimodal
    ):
        given = sorted(k for k, v in multimodal.items() if v is not None)
        if given:
            return self._treepack_vision(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss, multimodal
            )
        if "logits_to_keep" not in self.model_kwarg_keys:
            raise TreepackError("E_ARG", f"{type(unwrap(model)).__name__}.forward takes no logits_to_keep", field="logits_to_keep")
        B = input_ids.size(0)
        G = self.num_generations if self.model.training else self.num_generations_eval
        step = B if batch_size is None else -(-batch_size // G) * G  # whole groups: rows come group by group
        logps, entropies, aux = [], [], []
        for a in range(0, B, step):
            ids, att = input_ids[a : a + step], attention_mask[a : a + step]
            batch, layout = self._treepack_stored(ids, att) or from_padded(ids, att, response_length=logits_to_keep)
            self._treepack_record(int(att.sum()), batch.num_nodes)
            training = torch.is_grad_enabled() and self.model.training and unwrap(model) is unwrap(self.model)
            if training and self.treepack_cp_size > 1:
                scores = self._treepack_cp_forward(model, batch, compute_entropy, compute_aux_loss)
            elif "prefix_tokens" in batch.meta and training:
                scores = self._treepack_runner(model, compute_aux_loss).forward(batch)
            else:
                scores = forward_logprobs(
                    model,
                    batch,
                    temperature=self.temperature,
                    entropy=compute_entropy,
                    router=compute_aux_loss,
                    entropy_grad=self._entropy_bonus_enabled,
                    attention=self.treepack_attention,
                )
            logps.append(layout.to_padded(scores.logprobs))
            if compute_entropy:
                entropies.append(layout.to_padded(scores.entropy))
            if compute_aux_loss:  # each row's tokens counted as its padded row counts them (load_balancing_loss)
                aux.append(load_balancing_loss(scores.router, batch).to(logps[-1].dtype))
        return (
            torch.cat(logps),
            (torch.cat(entropies) if compute_entropy else None),
            (torch.stack(aux).mean() if compute_aux_loss else None),
        )

    def _treepack_cp_forward(self, model, batch: PackedBatch, entropy: bool, router: bool) -> NodeScores:
        """The policy's training forward under context parallelism: this rank's local part of the packed rows
        (``split_batch``, which checks that the group holds the same rows) runs on the model itself, and the scores
        come back as the whole row's (``whole_row``), so TRL's loss runs on every rank unchanged with the one-rank
        value while its gradient reaches this rank's nodes only (summed over the group by ``training_step``)."""
        why = ""
        if "prefix_tokens" in batch.meta:
            why = "a step plan's micro-batch (pack it without --prefix-reuse)"
        elif router:
            why = "the router's load-balancing loss (router_aux_loss_coef)"
        if why:
            raise TreepackError("E_ARG", f"context parallelism in the TRL integration does not run {why} yet", field="context_parallel")
        cp = self._treepack_cp = ContextParallel.of(batch, group=self.treepack_cp_group)
        local = split_batch(batch, cp)
        s = packed_logprobs(unwrap(model), local, temperature=self.temperature, entropy=entropy, attention=self.treepack_attention)
        ent, e = None, s.entropy
        if e is not None:  # TRL differentiates the entropies only for its entropy bonus
            ent = whole_row(e if self._entropy_bonus_enabled else e.detach(), local)
        return NodeScores(whole_row(s.logprobs, local), ent, scored_nodes(batch))

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """TRL's top-entropy mask, its quantile over the world's tokens; under context parallelism a group's ranks
        hold the same rows, so only the group's first rank adds its tokens, and its mask is the group's."""
        if self.treepack_cp_size == 1:
            return super().get_high_entropy_mask(entropies, mask, threshold)  # type: ignore[misc]
        import torch.distributed as dist

        group = self.treepack_cp_group
        first = dist.get_rank(group) == 0
        out = super().get_high_entropy_mask(entropies, mask if first else torch.zeros_like(mask), threshold)  # type: ignore[misc]
        flags = out.to(torch.uint8)
        dist.broadcast(flags, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
        return flags.bool()

    def _treepack_vision(self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss, multimodal):
        """Rows with images (Qwen2.5-VL, Qwen3-VL): each chunk of whole groups one forest in which a row's image is
        its pixel values' identity (``treepack.torch.vision.from_padded_images``), each distinct image encoded once,
        run by ``packed_logprobs`` on the model itself. Refused by name: other multimodal inputs and models, a model
        inside a wrapper (its own forward would place the images by token id), the router's aux loss."""
        base = unwrap(model)
        given = sorted(k for k, v in multimodal.items() if v is not None)
        other = [k for k in given if k not in _VISION_INPUTS]
        why = ""
        if vision_family(base) is None:
            why = f"{type(base).__name__} is not a vision-language model treepack runs"
        elif other:
            why = f"{', '.join(other)} are not inputs of the Qwen2-VL family"
        elif compute_aux_loss:
            why = "the router's load-balancing loss is not computed with images"
        elif base is not model:
            why = f"the model is inside {type(model).__name__}, whose own forward places images by token id, not by fill"
        elif self.treepack_cp_size > 1:
            why = "context parallelism does not split rows with images yet"
        if why:
            raise TreepackError("E_ARG", f"multimodal inputs ({', '.join(given)}) are not packed here: {why}", field=given[0])
        pixels, grid, counts = multimodal.get("pixel_values"), multimodal.get("image_grid_thw"), multimodal.get("num_images")
        if pixels is None or grid is None or counts is None:
            missing = next(k for k, v in (("pixel_values", pixels), ("image_grid_thw", grid), ("num_images", counts)) if v is None)
            raise TreepackError("E_ARG", f"images need pixel_values, image_grid_thw and num_images ({missing} is missing)", field=missing)
        B = input_ids.size(0)
        G = self.num_generations if self.model.training else self.num_generations_eval
        step = B if batch_size is None else -(-batch_size // G) * G
        image_starts = [0]
        for n in counts:
            image_starts.append(image_starts[-1] + n)
        patch_starts = torch.cat([grid.new_zeros(1), torch.cumsum(grid.prod(1), 0)]).tolist()
        logps, entropies = [], []
        for a in range(0, B, step):
            b = min(a + step, B)
            i0, i1 = image_starts[a], image_starts[b]
            batch, layout = from_padded_images(
                base,
                input_ids[a:b],
                attention_mask[a:b],
                logits_to_keep,
                pixels[patch_starts[i0] : patch_starts[i1]],
                grid[i0:i1],
                counts[a:b],
            )
            self._treepack_record(int(attention_mask[a:b].sum()), batch.num_nodes)
            scores = packed_logprobs(base, batch, entropy=compute_entropy, attention=self.treepack_attention, temperature=self.temperature)
            logps.append(layout.to_padded(scores.logprobs))
            if compute_entropy:
                entropies.append(layout.to_padded(scores.entropy))
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None

    def _treepack_runner(self, model, router: bool) -> StepPlanRunner:
        """The policy's step-plan runner, made at its first planned micro-batch; ``router``: it keeps the router
        logits of what it caches, for the load-balancing loss."""
        runner = self.__dict__.get("_treepack_plan")
        if runner is None:
            # Under DDP the runner works inside the wrapper (FSDP and DeepSpeed are refused by name), so no backward
            # synchronises; training_step averages the gradients once, after the accumulation's last pops.
            runner = self._treepack_plan = StepPlanRunner(
                model, attention=self.treepack_attention, temperature=self.temperature, entropy=True, router=router
            )
        elif runner.router != router:
            if runner.stack:
                raise TreepackError(
                    "E_ARG",
                    "the load-balancing loss was switched on or off while the step plan holds a cached prefix",
                    field="router_aux_loss_coef",
                )
            runner.router = router
        return runner

    def training_step(self, model, inputs, num_items_in_batch=None):
        """TRL's step (forward, loss, backward), then the releases of a planned micro-batch, under the same autocast
        as its forward; an optimizer step while a prefix is still cached is refused (its gradient is incomplete)."""
        out = super().training_step(model, inputs, num_items_in_batch)
        if self.treepack_cp_size > 1 and self._step % self.current_gradient_accumulation_steps == 0:
            # The forwards ran on the model itself, so DDP's hooks never fired: each rank holds its local parts' share.
            reduce_gradients(unwrap(model), self._treepack_cp)  # summed over the CP group: its rows' gradient
            if self.treepack_dp_size > 1:  # averaged over the world: the average over the data-parallel groups
                if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
                    raise TreepackError(
                        "E_ARG",
                        f"several data-parallel groups average their gradients through DistributedDataParallel, not {type(model).__name__}",
                        field="context_parallel",
                    )
                sync_gradients(model)
        runner = self.__dict__.get("_treepack_plan")
        if runner is not None and runner.pending is not None:
            with self.compute_loss_context_manager():
                runner.release()
            if self._step % self.current_gradient_accumulation_steps == 0:
                if runner.stack:
                    raise TreepackError(
                        "E_INPUT",
                        f"the optimizer steps after micro-batch {self._step} while the step plan holds "
                        f"{runner.depth} cached prefix tokens: set gradient_accumulation_steps (and steps_per_generation) "
                        "to a rank's micro-batches of one packing window",
                        field="gradient_accumulation_steps",
                    )
                runner.sync_gradients()  # under DDP: the one all-reduce of the accumulation
        return out

    def _generate_single_turn(self, *args, **kwargs):
        """TRL's own generation (transformers ``generate``: padded causal masks, a KV cache) runs with SDPA; the
        packed forwards get the tree attention back."""
        base = unwrap(self.model)
        impl = base.config._attn_implementation
        if impl != "treepack":
            return super()._generate_single_turn(*args, **kwargs)
        base.set_attn_implementation("sdpa")
        try:
            return super()._generate_single_turn(*args, **kwargs)
        finally:
            base.set_attn_implementation(impl)

    @property
    def treepack_stats(self) -> list[tuple[int, int]]:
        """(naive tokens, packed nodes) of every packed forward so far: the compression the trainer got."""
        return self.__dict__.setdefault("_treepack_stats", [])

    def _treepack_record(self, tokens: int, nodes: int) -> None:
        stats = self.treepack_stats
        stats.append((tokens, nodes))
        del stats[: -self.STATS_KEPT]
        if self.model.training:
            self._metrics["train"]["treepack/compression"].append(tokens / max(1, nodes))

    def _treepack_stored(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[PackedBatch, RowLayout] | None:
        """The stored forest these rows came from (GroupedBatchesMixin's packed source), so it is reused, not rebuilt."""
        for ids, att, batch, layout in self.__dict__.get("_treepack_forests", ()):
            if ids.shape == input_ids.shape and torch.equal(ids, input_ids) and torch.equal(att, attention_mask):
                return batch, layout
        return None


class GroupedBatchesMixin:
    """Overrides ``_prepare_inputs`` in training: a generation batch is split into ``steps_per_generation``
    micro-batches of whole groups (``plan_micro_batches``, balanced by cost, each within
    ``treepack_max_tokens`` when set) instead of TRL's row shuffle, which scatters a group's shared prompt over
    micro-batches. Group order follows the forest (no shuffle): micro-batches of one generation batch feed the
    same optimizer step unless ``steps_per_generation`` exceeds ``gradient_accumulation_steps``.

    Losses normalised per micro-batch (``grpo``, ``bnpo``, ``dr_grpo``) depend on the split by definition; ``dapo``
    and ``cispo`` divide by the generation batch's tokens and do not.

    With ``treepack_packed_batches`` (an iterable of ``PackedBatch`` or ``treepack.client.FeedMicroBatch``), each of
    its micro-batches is one TRL micro-batch: no generation, no reward functions (the stored advantages are
    used), the stored forest reused by the forward; feed micro-batches are acknowledged once TRL is done with them
    (when the next window is drawn, and at the end of training)."""

    treepack_max_tokens: int | None = None
    treepack_packed_batches: Iterable[Any] | None = None
    treepack_cp_size: int = 1  # as PackedForwardMixin's
    treepack_cp_group: Any = None

    # Read from the GRPOTrainer the mixin is mixed into (declared for the type checker; no values here; Any where
    # TRL's own type differs between its versions).
    args: Any
    accelerator: Any
    model: Any
    ref_model: Any
    beta: float
    num_generations: Any
    num_iterations: int
    _tokenizer: Any
    _get_per_token_logps_and_entropies: Callable[..., Any]
    # The stored forests of the current window: (input_ids, attention_mask, batch, layout) as TRL's rows hold them.
    _treepack_forests: list[tuple[torch.Tensor, torch.Tensor, PackedBatch, RowLayout]]

    def _prepare_inputs(self, generation_batch):
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            if self.treepack_packed_batches is None:
                inputs = self._generate_and_score_completions(generation_batch)
                if self.treepack_cp_size > 1:
                    inputs = self._treepack_cp_rows(inputs)
                self._buffered_inputs = self._treepack_split(inputs)
            else:
                self._buffered_inputs = self._treepack_window()
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _treepack_split(self, inputs: dict[str, Any]) -> list[dict[str, Any]]:
        images = [k for k in _IMAGE_TENSORS if inputs.get(k) is not None]
        if images and len(images) != len(_IMAGE_TENSORS):
            missing = next(k for k in _IMAGE_TENSORS if k not in images)
            raise TreepackError("E_ARG", f"{', '.join(images)} without {missing}: the rows' images cannot be grouped", field=missing)
        rows = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        keep = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1).bool()
        B, G = rows.shape[0], self.num_generations
        plan = plan_micro_batches(
            [rows[i][keep[i]].tolist() for i in range(B)],
            max_tokens=self.treepack_max_tokens,
            groups=[i // G for i in range(B)],
            num_micro_batches=self.args.steps_per_generation,
        )
        split = []
        for mb in plan.micro_batches:
            part = _take({k: v for k, v in inputs.items() if k not in _IMAGE_TENSORS}, torch.as_tensor(mb.sequences, device=rows.device), B)
            split.append({**part, **(_take_images(inputs, [int(r) for r in mb.sequences]) if images else {})})
        return split

    def _treepack_cp_rows(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The rows of every rank of this rank's context-parallel group (one ``all_gather_object``), in rank order,
        re-padded to common widths: the group trains them together, as one data-parallel rank with K times the
        per-device batch. ``num_items_in_batch`` (TRL's gather over the world) is scaled by K: TRL divides it by the
        world's processes, the group's rows are one data-parallel rank's."""
        import torch.distributed as dist

        K, G = self.treepack_cp_size, self.num_generations
        B = inputs["prompt_ids"].shape[0]
        if B % G:
            raise TreepackError(
                "E_ARG",
                f"a rank's generation batch holds {B} rows, not whole groups of num_generations = {G}: context parallelism gathers "
                "the group's rows by whole groups (per_device_train_batch_size * steps_per_generation a multiple of num_generations)",
                field="context_parallel",
            )
        images = [k for k in _IMAGE_TENSORS if inputs.get(k) is not None]
        if images:
            raise TreepackError("E_ARG", "context parallelism does not split rows with images yet", field=images[0])
        device = inputs["prompt_ids"].device
        mine = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        parts: list[Any] = [None] * K
        dist.all_gather_object(parts, mine, group=self.treepack_cp_group)
        P = max(p["prompt_ids"].shape[1] for p in parts)
        C = max(p["completion_ids"].shape[1] for p in parts)
        pad = self._tokenizer.pad_token_id
        out: dict[str, Any] = {}
        for k, v in inputs.items():
            got = [p[k] for p in parts]
            if k == "num_items_in_batch":
                out[k] = v * K
            elif isinstance(v, torch.Tensor) and v.ndim == 2 and v.shape[0] == B:
                fill = pad if k in ("prompt_ids", "completion_ids") else 0
                if k.startswith("prompt_"):  # left-padded
                    got = [torch.nn.functional.pad(x, (P - x.shape[1], 0), value=fill) for x in got]
                elif all(x.shape[1] == p["completion_ids"].shape[1] for x, p in zip(got, parts)):  # per completion token
                    got = [torch.nn.functional.pad(x, (0, C - x.shape[1]), value=fill) for x in got]
                out[k] = torch.cat(got).to(device)
            elif isinstance(v, torch.Tensor) and v.ndim == 1 and v.shape[0] == B:
                out[k] = torch.cat(got).to(device)
            elif isinstance(v, list) and len(v) == B:
                out[k] = [x for g in got for x in g]
            else:
                out[k] = v
        return out

    def _treepack_window(self) -> list[dict[str, Any]]:
        """The next ``steps_per_generation`` stored micro-batches as TRL inputs; acknowledges the previous window."""
        self.treepack_ack()
        if "_treepack_source" not in self.__dict__:
            if self.treepack_packed_batches is None:
                raise TreepackError("E_ARG", "no packed_batches to train on", field="packed_batches")
            self._treepack_source: Iterator[Any] = iter(self.treepack_packed_batches)
        items = []
        for _ in range(self.args.steps_per_generation):
            item = next(self._treepack_source, None)
            if item is None:
                raise TreepackError(
                    "E_INPUT", "the packed source ran out; set max_steps to the optimizer steps it holds", field="packed_batches"
                )
            items.append(item)
        self._treepack_pending = [x for x in items if hasattr(x, "ack")]
        batches = [getattr(x, "batch", x) for x in items]
        device = self.accelerator.device
        trainable = torch.tensor(sum(int(b.loss_mask.sum()) for b in batches), device=device)
        num_items = self.accelerator.gather(trainable).sum()
        self._treepack_forests = []
        return [self._treepack_inputs(b.to(device), num_items) for b in batches]

    def _treepack_inputs(self, batch: PackedBatch, num_items: torch.Tensor) -> dict[str, Any]:
        """One stored micro-batch as TRL's inputs: prompt = the tokens before a sequence's first trainable token,
        ``tool_mask`` = its loss mask over the completion, per-token advantages, stored old / rollout / reference
        logprobs where the batch has them (old and reference computed, on the stored forest, where TRL would)."""
        if batch.advantages is None:
            raise TreepackError("E_INPUT", "the micro-batch has no advantages", field="advantages")
        rows, layout = padded_rows(batch, self._tokenizer.pad_token_id)
        ids = torch.cat([rows["prompt_ids"], rows["completion_ids"]], 1)
        att = torch.cat([rows["prompt_mask"], rows["completion_mask"]], 1)
        self._treepack_forests.append((ids, att, batch, layout))

        def per_token(values: torch.Tensor | None) -> torch.Tensor | None:
            return None if values is None else layout.to_padded(values, of="occurrences", where="all")

        out: dict[str, Any] = {k: rows[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        out.update(tool_mask=rows["loss_mask"], advantages=per_token(batch.advantages), num_items_in_batch=num_items)
        C = rows["completion_ids"].shape[1]
        old, ref, sampled = per_token(batch.old_logprobs), per_token(batch.ref_logprobs), per_token(batch.rollout_logprobs)
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            if old is None and self.args.gradient_accumulation_steps % (self.args.steps_per_generation * self.num_iterations):
                old = self._get_per_token_logps_and_entropies(self.model, ids, att, C)[0]
            if ref is None and self.beta != 0.0:
                if self.ref_model is not None:
                    ref = self._get_per_token_logps_and_entropies(self.ref_model, ids, att, C)[0]
                else:
                    peft_model = self.accelerator.unwrap_model(self.model)
                    with use_adapter(peft_model, adapter_name="ref" if "ref" in peft_model.peft_config else None):
                        ref = self._get_per_token_logps_and_entropies(self.model, ids, att, C)[0]
        for key, v in (("old_per_token_logps", old), ("ref_per_token_logps", ref), ("sampling_per_token_logps", sampled)):
            if v is not None:
                out[key] = v
        return out

    def treepack_ack(self) -> None:
        """Acknowledges the feed micro-batches of the current window (TRL is done with them)."""
        for item in self.__dict__.pop("_treepack_pending", []):
            item.ack()


def _take(inputs: dict[str, Any], rows: torch.Tensor, B: int) -> dict[str, Any]:
    """The given rows of every per-row entry (tensors and lists of length B); scalars as they are."""
    out: dict[str, Any] = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor) and v.ndim > 0 and v.shape[0] == B:
            out[k] = v.index_select(0, rows)
        elif isinstance(v, list) and len(v) == B:
            out[k] = [v[i] for i in rows.tolist()]
        else:
            out[k] = v
    return out


def _take_images(inputs: dict[str, Any], rows: list[int]) -> dict[str, Any]:
    """The given rows' images: their ``num_images``, ``image_grid_thw`` rows and ``pixel_values`` rows (each image
    t·h·w of them), in row order, as TRL lays them out."""
    counts, grid, pixels = inputs["num_images"], inputs["image_grid_thw"], inputs["pixel_values"]
    first = [0]
    for n in counts:
        first.append(first[-1] + n)
    patches = grid.prod(1).tolist()
    at = [0]
    for n in patches:
        at.append(at[-1] + n)
    chosen = [i for r in rows for i in range(first[r], first[r + 1])]
    parts = [pixels[at[i] : at[i + 1]] for i in chosen]
    return {
        "num_images": [counts[r] for r in rows],
        "image_grid_thw": grid[chosen],
        "pixel_values": torch.cat(parts) if parts else pixels[:0],
    }


def _no_reward(completions, **kwargs):
    """The reward function of training on stored micro-batches, never called: their advantages are stored."""
    raise TreepackError("E_ARG", "rewards are not computed when training on stored micro-batches")


class TreepackGRPOTrainer(PackedForwardMixin, GroupedBatchesMixin, GRPOTrainer):
    """``GRPOTrainer`` with packed forwards and group-whole micro-batches (see the mixins). Extra arguments:
    ``treepack_max_tokens`` (packed tokens per micro-batch, refused when a split cannot meet it),
    ``treepack_attention`` (the TreeMask mode, ``"auto"``), ``packed_batches`` (train on stored micro-batches:
    ``PackedDataset``, ``FeedClient`` or any iterable of ``PackedBatch``; ``max_steps`` must be set),
    ``context_parallel`` (K > 1: each packed row of the policy's training forward split over consecutive groups of
    K processes; the module docstring)."""

    def __init__(
        self,
        *args: Any,
        treepack_max_tokens: int | None = None,
        treepack_attention: str = "auto",
        packed_batches: Iterable[Any] | None = None,
        context_parallel: int = 1,
        **kwargs: Any,
    ):
        if packed_batches is not None:
            cfg = kwargs.get("args")
            if cfg is None or cfg.max_steps <= 0:
                raise TreepackError(
                    "E_ARG", "training on stored micro-batches needs args.max_steps > 0 (the dataset is a placeholder)", field="max_steps"
                )
            if kwargs.get("train_dataset") is None:
                from datasets import Dataset

                kwargs["train_dataset"] = Dataset.from_dict({"prompt": [""] * cfg.generation_batch_size * cfg.max_steps})
            kwargs["reward_funcs"] = kwargs.get("reward_funcs") or _no_reward
        super().__init__(*args, **kwargs)
        self.treepack_max_tokens = treepack_max_tokens
        self.treepack_attention = treepack_attention
        self.treepack_packed_batches = packed_batches
        self.treepack_cp_size, self.treepack_cp_group, self.treepack_dp_size = self._treepack_cp_groups(context_parallel)

    def _treepack_cp_groups(self, size: int) -> tuple[int, Any, int]:
        """(K, this rank's context-parallel group, data-parallel groups): the world's ranks in consecutive groups of
        K (every rank creates every group, in order); K = 1: (1, None, 1)."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise TreepackError("E_ARG", f"expected an integer >= 1, got {size!r}", field="context_parallel")
        if size == 1:
            return 1, None, 1
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        why = ""
        if world % size:
            why = f"the world's {world} processes do not split into groups of {size}: launch a multiple of {size} processes"
        elif self.is_fsdp_enabled or self.is_deepspeed_enabled:
            why = "FSDP and DeepSpeed are not supported: the split forward runs the model's modules itself (use DDP)"
        if why:
            raise TreepackError("E_ARG", f"context_parallel={size}: {why}", field="context_parallel")
        rank = dist.get_rank()
        groups = [None] if world == size else [dist.new_group(list(range(g, g + size))) for g in range(0, world, size)]
        return size, groups[rank // size if world > size else 0], world // size

    def train(self, *args: Any, **kwargs: Any) -> Any:
        out = super().train(*args, **kwargs)
        self.treepack_ack()
        return out

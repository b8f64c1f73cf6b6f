"""The loop fitted to the device: micro-batches grown and shrunk within the run's batch,
fp16 with a gradient scaler where bf16 is missing, the loss inside what is compiled, and
a bf16 residual stream under autocast. All on the CPU: budgets are simulated, fp16 and
bf16 are forced (torch's CPU autocast serves both), the compiled loss runs uncompiled."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from dipaco.config import GiB, InnerConfig, LayoutConfig, ModelConfig, RunConfig
from dipaco.inner import DoesNotFit, PathTrainer, fit_micro_batch, precision_for
from dipaco.inner.engine import WholeLoss
from dipaco.inner.fit import larger_micro_batches, path_memory
from dipaco.inner.loss import CausalLMLoss, LinearCrossEntropy, _add_weight_grad
from dipaco.model import build_model
from dipaco.modular import init_modules
from tests.test_inner import CFG, SOURCE

SHORT = CFG.model_copy(update={"inner": CFG.inner.model_copy(update={"steps": 6})})
# The papers' 150M path, 64 x 1,024 tokens a step, split as the run's default (8 x 8).
PATH_150M = RunConfig(
    model=ModelConfig(),
    layout=LayoutConfig.grid(12, 2, 2),
    inner=InnerConfig(micro_batch_size=8, grad_accum_steps=8),
)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float((a[k] - b[k]).norm() ** 2) for k in b) ** 0.5
    return num / sum(float(b[k].norm() ** 2) for k in b) ** 0.5


@pytest.mark.parametrize("whole_logits", [False, True])
@pytest.mark.parametrize("gib", [8, 12, 24])
def test_the_micro_batch_grows_to_the_largest_that_a_simulated_budget_holds(
    gib: int, whole_logits: bool
) -> None:
    budget = gib * GiB
    fitted = fit_micro_batch(PATH_150M, budget, "cuda", whole_logits=whole_logits)
    assert fitted.batch_size == PATH_150M.inner.batch_size, "the same batch, split otherwise"
    assert path_memory(PATH_150M, fitted, "cuda", whole_logits=whole_logits) <= budget
    for larger in larger_micro_batches(fitted):
        assert path_memory(PATH_150M, larger, "cuda", whole_logits=whole_logits) > budget


def test_more_memory_never_fits_a_smaller_micro_batch_and_a_big_card_takes_the_whole_batch() -> (
    None
):
    micro = [fit_micro_batch(PATH_150M, g * GiB, "cuda").micro_batch_size for g in (8, 12, 24)]
    assert micro == sorted(micro) and micro[0] < micro[-1]
    whole = fit_micro_batch(PATH_150M, 80 * GiB, "cuda", whole_logits=True)
    assert (whole.micro_batch_size, whole.grad_accum_steps) == (64, 1)
    assert fit_micro_batch(PATH_150M, None, "cuda") == PATH_150M.inner
    assert fit_micro_batch(PATH_150M, 80 * GiB, "cuda", grow=False) == PATH_150M.inner
    # A budget below the run's split shrinks it; below one sequence, the advice.
    shrunk = fit_micro_batch(PATH_150M, 5 * GiB, "cuda")
    assert shrunk.micro_batch_size < 8 and shrunk.batch_size == 64
    with pytest.raises(DoesNotFit, match="--memory-cap"):
        fit_micro_batch(PATH_150M, 2 * GiB, "cuda")


def test_a_grown_micro_batch_trains_the_delta_of_the_runs_split() -> None:
    split = {"micro_batch_size": 1, "grad_accum_steps": 4}
    config = SHORT.model_copy(update={"inner": SHORT.inner.model_copy(update=split)})
    budget = path_memory(config, config.inner.model_copy(
        update={"micro_batch_size": 4, "grad_accum_steps": 1}), "cpu")  # fmt: skip
    grown = fit_micro_batch(config, budget)
    assert (grown.micro_batch_size, grown.grad_accum_steps) == (4, 1)
    modules = init_modules(config)
    split = PathTrainer(config).train_path(config, 0, modules, SOURCE)
    whole_config = config.model_copy(update={"inner": grown})
    whole = PathTrainer(whole_config).train_path(whole_config, 0, modules, SOURCE)
    assert whole.tokens == split.tokens
    assert whole.losses == pytest.approx(split.losses, rel=1e-5)
    assert relative_error(whole.delta, split.delta) < 1e-4


def test_fp16_with_a_gradient_scaler_trains_as_fp32_does_and_skips_overflowing_steps() -> None:
    assert precision_for(torch.device("cpu")) == "fp32"
    assert precision_for(torch.device("cpu"), "fp16") == "fp16"
    modules = init_modules(SHORT)
    fp32 = PathTrainer(SHORT).train_path(SHORT, 0, modules, SOURCE)
    trainer = PathTrainer(SHORT, precision="fp16")
    assert trainer.engine.scaler is not None
    fp16 = trainer.train_path(SHORT, 0, modules, SOURCE)
    assert fp16.losses == pytest.approx(fp32.losses, rel=1e-3)
    assert relative_error(fp16.delta, fp32.delta) < 0.05
    # A scale that overflows fp16's gradients: every step is skipped, the scale halves.
    overflowing = PathTrainer(SHORT, precision="fp16")
    overflowing.engine.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**60)
    skipped = overflowing.train_path(SHORT, 0, modules, SOURCE)
    assert all(float(d.abs().max()) == 0.0 for d in skipped.delta.values())
    assert overflowing.engine.scaler.get_scale() == 2.0 ** (60 - SHORT.inner.steps)
    assert all(loss == loss for loss in skipped.losses), "the losses stay finite"


def test_the_compiled_loss_is_the_eager_loss_with_its_gradients() -> None:
    """WholeLoss (what CUDA compiles: body, head, cross-entropy) against the eager path
    (the body, then CausalLMLoss), uncompiled on the CPU: in fp32 to float rounding, under
    bf16 autocast within bf16's."""
    model = build_model(CFG.model, 0)
    window = SOURCE.batch(0, 4, CFG.model.seq_len)  # (B, T+1)
    inputs, targets = window[:, :-1], window[:, 1:]
    for dtype, rtol, atol in ((torch.float32, 1e-5, 1e-7), (torch.bfloat16, 3e-2, 3e-3)):
        results = []
        for loss_fn in (
            WholeLoss(model),
            lambda i, t: CausalLMLoss(model, torch.device("cpu"), fused=True)(model.model, i, t),
        ):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                loss = loss_fn(inputs, targets)
            loss.backward()
            results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        (whole, whole_grads), (eager, eager_grads) = results
        torch.testing.assert_close(whole, eager, rtol=rtol, atol=0)
        for name, grad in eager_grads.items():
            assert grad is not None and grad.dtype == torch.float32
            torch.testing.assert_close(whole_grads[name], grad, rtol=rtol, atol=atol, msg=name)


def test_the_chunked_loss_sums_its_weight_gradient_in_fp32() -> None:
    """Chunk by chunk in bf16, each chunk's (V, C) product added to the fp32 sum unrounded:
    the same as one fp32 matmul over all the chunks' bf16 values."""
    g = torch.Generator().manual_seed(3)
    grads = torch.randn(64, 40, generator=g).bfloat16()  # (N, V)
    hidden = torch.randn(64, 16, generator=g).bfloat16()  # (N, C)
    total = torch.zeros(40, 16)
    for start in range(0, 64, 8):
        _add_weight_grad(total, grads[start : start + 8], hidden[start : start + 8])
    torch.testing.assert_close(total, grads.float().T @ hidden.float(), rtol=1e-6, atol=1e-6)
    # And the fused loss's weight gradient over 50 one-token chunks stays near the fp32 one.
    h = torch.randn(50, 16, generator=g, requires_grad=True)
    w = torch.randn(40, 16, generator=g, requires_grad=True)
    t = torch.randint(40, (50,), generator=g)
    reference = torch.autograd.grad(F.cross_entropy(F.linear(h, w), t), w)[0]
    fused = torch.autograd.grad(LinearCrossEntropy.apply(h, w, t, 1, torch.bfloat16), w)[0]
    torch.testing.assert_close(fused, reference, rtol=2e-2, atol=2e-3)


def test_under_autocast_the_residual_stream_is_bf16_and_the_fp32_path_is_unchanged() -> None:
    model = build_model(CFG.model, 0)
    inputs = SOURCE.batch(0, 2, CFG.model.seq_len)[:, :-1]  # (B, T)
    seen: list[torch.dtype] = []
    hooks = [block.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
             for block in model.model.layers]  # fmt: skip
    plain = model.model(input_ids=inputs).last_hidden_state
    assert plain.dtype == torch.float32 and seen == [torch.float32] * len(hooks)
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = model.model(input_ids=inputs).last_hidden_state
    assert mixed.dtype == torch.bfloat16 and seen == [torch.bfloat16] * len(hooks)
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(mixed.float(), plain, rtol=0.1, atol=0.1)

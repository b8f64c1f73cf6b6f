"""`dipaco simulate`: a seconds-long DiPaCo and DiLoCo on a few dozen stdlib documents."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from dipaco.cli import main as dipaco_main
from dipaco.cli.simulate import DEFAULT_BASE_STEPS, add_arguments, base_steps, build_config
from dipaco.config import LayoutConfig, RunConfig
from dipaco.evaluate import evaluate_model, stream_windows
from dipaco.model import build_model
from dipaco.modular import init_modules
from dipaco.simulate import DataBudget, SimulateOptions, SimulationResult, prepare_data, simulate
from dipaco.simulate.base import cache_path, train_base
from dipaco.simulate.train import apply_update, publish_update

BUDGET = DataBudget(max_docs=60, tokenizer_chars=300_000)


def tiny_config(**changes: Any) -> RunConfig:
    """hidden 64, 2 layers, vocab 512, seq 64: one inner step takes milliseconds."""
    model = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
             "intermediate_size": 192, "vocab_size": 512, "seq_len": 64}  # fmt: skip
    sections: dict[str, Any] = {
        "model": model,
        "layout": LayoutConfig.grid(2, levels=2, modules=2),
        "rounds": 3,
        "inner": {"steps": 5, "warmup_steps": 2},
        "data": {"val_fraction": 0.2},
        **changes,
    }
    return RunConfig.tiny(**sections)


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the suite shares two cores with other work
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("simulate-work")


@pytest.fixture(scope="module")
def dipaco_run(work_dir: Path) -> SimulationResult:
    torch.set_num_threads(1)
    options = SimulateOptions(budget=BUDGET, work_dir=work_dir, eval_windows=32)
    return simulate(tiny_config(), options)


@pytest.fixture(scope="module")
def diloco_run(work_dir: Path) -> SimulationResult:
    torch.set_num_threads(1)
    config = tiny_config(layout=LayoutConfig.diloco(2), replicas_per_path=2, comm={"codec": "int8"})
    options = SimulateOptions(
        budget=BUDGET, work_dir=work_dir, eval_windows=32, baselines=("data-parallel",)
    )
    return simulate(config, options)


def test_dipaco_routed_validation_loss_falls_over_the_rounds(dipaco_run: SimulationResult) -> None:
    rounds = dipaco_run.run.rounds
    assert [r.round for r in rounds] == [0, 1, 2, 3]
    assert rounds[-1].routed_loss < rounds[0].routed_loss - 0.1
    # Before training every path is the same random model: loss near ln(vocab).
    assert abs(rounds[0].routed_loss - math.log(512)) < 0.5
    assert dipaco_run.run.units == 3 * 4


def test_dipaco_baselines_run_on_the_same_tokens_and_report_finite_losses(
    dipaco_run: SimulationResult,
) -> None:
    assert set(dipaco_run.baselines) == {"data-parallel", "dense", "dense-steps"}
    for name, baseline in dipaco_run.baselines.items():
        assert math.isfinite(baseline.loss)
        assert baseline.loss < dipaco_run.run.rounds[0].routed_loss
        # dense-steps matches one path's sequential steps (equal wall-clock), not the tokens
        share = 4 if name == "dense-steps" else 1
        assert baseline.tokens * share == dipaco_run.run.tokens
        assert [p.tokens for p in baseline.paths] == dipaco_run.windows.tokens
    dp, dense = dipaco_run.baselines["data-parallel"], dipaco_run.baselines["dense"]
    steps = dipaco_run.baselines["dense-steps"]
    assert (dp.steps, dense.steps, steps.steps) == (3 * 5, 3 * 5 * 4, 3 * 5)
    assert dp.batch_size == 4 * dense.batch_size == 4 * steps.batch_size


def test_dipaco_sends_fewer_bytes_than_data_parallel(dipaco_run: SimulationResult) -> None:
    run = dipaco_run.run
    assert run.upload_bytes > 0 and run.download_bytes > 0
    # Every unit downloads its whole path in fp32 and uploads it in fp16, zstd-compressed
    # (comm.compression): the bytes counted are the frames', below fp16's 2 bytes a value.
    path_bytes = 4 * dipaco_run.config.num_params()
    assert run.download_bytes == run.units * path_bytes
    assert dipaco_run.config.comm.compression == "zstd"
    assert path_bytes / 2 * 0.75 < run.upload_bytes / run.units < path_bytes / 2
    assert 0 < dipaco_run.bytes_total < dipaco_run.data_parallel_bytes


def test_each_validation_document_is_scored_by_the_path_it_routes_to(
    dipaco_run: SimulationResult,
) -> None:
    data = dipaco_run.data
    assert data.router is not None and data.num_paths == 4
    assert sum(data.docs("val")) == data.meta["val_docs"]
    assert sum(data.docs("train")) == data.meta["train_docs"]
    for p, windows in enumerate(dipaco_run.windows.per_path):
        stream = data.val_tokens(p)
        assert stream.numel() == data.tokens("val")[p]
        own = {tuple(w.tolist()) for w in stream_windows(stream, windows.shape[1] - 1)}
        assert all(tuple(w.tolist()) in own for w in windows)  # windows of its own val shard
    final = dipaco_run.run.rounds[-1]
    scored = [(x.loss, x.tokens) for x in final.paths if x.loss is not None]
    expected = sum(loss * n for loss, n in scored) / sum(n for _, n in scored)
    assert final.routed_loss == pytest.approx(expected)


def test_the_baselines_read_every_training_document(dipaco_run: SimulationResult) -> None:
    data = dipaco_run.data
    assert data.everything.num_paths == 1
    assert data.everything.info(0, "train").tokens == sum(data.tokens("train"))
    assert data.everything.info(0, "train").docs == sum(data.docs("train"))


def test_diloco_with_two_replicas_learns_and_uploads_int8(
    diloco_run: SimulationResult, dipaco_run: SimulationResult
) -> None:
    rounds = diloco_run.run.rounds
    assert diloco_run.method == "diloco" and diloco_run.run.units == 3 * 2
    assert rounds[-1].routed_loss < rounds[0].routed_loss - 0.1
    assert math.isfinite(diloco_run.baselines["data-parallel"].loss)
    # The same path size as the 2x2 run's paths: int8 (+ one fp32 scale per 64) vs fp16.
    int8_unit = diloco_run.run.upload_bytes / diloco_run.run.units
    fp16_unit = dipaco_run.run.upload_bytes / dipaco_run.run.units
    assert int8_unit < 0.6 * fp16_unit
    assert diloco_run.bytes_total < diloco_run.data_parallel_bytes


def test_prepared_data_is_reused_only_for_the_same_inputs(
    work_dir: Path, dipaco_run: SimulationResult
) -> None:
    again = prepare_data(tiny_config(rounds=1, inner={"steps": 2}), BUDGET, work_dir)
    assert again.reused and again.key == dipaco_run.data.key
    assert again.tokens("train") == dipaco_run.data.tokens("train")
    other = prepare_data(tiny_config(seed=1), BUDGET, work_dir)
    assert not other.reused and other.key != dipaco_run.data.key


def test_a_simulation_is_deterministic(work_dir: Path) -> None:
    config = tiny_config(rounds=1, inner={"steps": 3, "warmup_steps": 1})
    options = SimulateOptions(budget=BUDGET, work_dir=work_dir, eval_windows=8, baselines=())
    first, second = simulate(config, options), simulate(config, options)
    assert first.run.rounds[-1].routed_loss == second.run.rounds[-1].routed_loss
    assert first.run.upload_bytes == second.run.upload_bytes


def test_a_base_phase_gives_every_path_the_same_trained_start(
    work_dir: Path, dipaco_run: SimulationResult
) -> None:
    config = tiny_config(rounds=1, inner={"steps": 2, "warmup_steps": 1})
    options = SimulateOptions(
        budget=BUDGET, work_dir=work_dir, eval_windows=32, baselines=("dense",), base_steps=15
    )
    result = simulate(config, options)
    start = result.run.rounds[0]
    assert start.routed_loss < dipaco_run.run.rounds[0].routed_loss - 0.3
    assert cache_path(config, result.data, 15).is_file()  # cached for the next run
    # Before round 1 every path is the base model itself.
    base = build_model(config.model, config.seed)
    base.load_state_dict(train_base(config, result.data, 15))  # from the cache
    expected = evaluate_model(base, result.windows)
    assert [x.loss for x in start.paths] == pytest.approx([x.loss for x in expected])
    assert result.to_json()["base_steps"] == 15


def test_one_base_model_serves_methods_trained_at_different_batches(
    dipaco_run: SimulationResult,
) -> None:
    small, large = (
        tiny_config(inner={"micro_batch_size": 4}),
        tiny_config(inner={"micro_batch_size": 16}),
    )
    data = dipaco_run.data
    assert cache_path(small, data, 15, batch_size=4) == cache_path(large, data, 15, batch_size=4)
    assert cache_path(small, data, 15, batch_size=4) != cache_path(small, data, 15, batch_size=8)
    # Without a base batch each method's base trains at its own batch, and is its own.
    assert cache_path(small, data, 15) != cache_path(large, data, 15)


def test_the_cli_routes_with_the_base_model_unless_told_tfidf() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)

    paper = parser.parse_args([])
    config = build_config(paper)
    assert config.router.featurizer == "base-lm"
    assert base_steps(paper, config) == DEFAULT_BASE_STEPS

    fallback = parser.parse_args(["--router", "tfidf", "--router-method", "product-kmeans"])
    config = build_config(fallback)
    assert (config.router.featurizer, config.router.method) == ("tfidf", "product-kmeans")
    assert base_steps(fallback, config) == 0
    assert base_steps(parser.parse_args(["--base-steps", "7"]), config) == 7


def test_the_first_phase_2_round_does_not_step_back_from_the_phase_1_model(
    work_dir: Path,
) -> None:
    """The paper's recipe, seeded: phase 2 starts every module from a 200-step base model whose
    features route the documents. With torch SGD's first Nesterov step (1.7 x the mean Δ)
    this run's first round went from 4.839 to 4.856; dipaco.outer.round_momentum makes that
    step the mean Δ, without momentum (4.807)."""
    config = tiny_config(
        rounds=2, inner={"steps": 10, "warmup_steps": 2}, router={"featurizer": "base-lm"}
    )
    options = SimulateOptions(budget=BUDGET, work_dir=work_dir, baselines=(), base_steps=200)

    rounds = simulate(config, options).run.rounds

    assert rounds[1].routed_loss <= rounds[0].routed_loss  # on the same validation sample
    assert rounds[2].routed_loss < rounds[0].routed_loss


def test_the_cli_help_teaches_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        dipaco_main(["simulate", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--paths" in text and "--diloco" in text and "examples:" in text
    assert "--router {base-lm,tfidf}" in text


def test_the_cli_writes_the_results_as_json(
    tmp_path: Path, work_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_file = tmp_path / "run.json"
    config_file.write_text(tiny_config().model_dump_json())
    out = tmp_path / "result.json"
    code = dipaco_main([
        "simulate", "--config", str(config_file), "--rounds", "2", "--inner-steps", "3",
        "--codec", "fp32", "--max-docs", "60", "--eval-windows", "16", "--threads", "1",
        "--work-dir", str(work_dir), "--baselines", "dense", "--no-progress", "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    assert result["method"] == "dipaco"
    assert result["config"]["comm"]["codec"] == "fp32"
    assert [r["round"] for r in result["rounds"]] == [0, 1, 2]
    assert set(result["baselines"]) == {"dense"}
    assert result["bytes"]["total"] < result["bytes"]["data_parallel"]
    printed = capsys.readouterr().out
    assert "routed" in printed and "perplexity ratio dipaco / dense" in printed


def test_the_cli_refuses_a_bad_config_naming_the_setting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = dipaco_main(["simulate", "--paths", "5x2", "--no-progress"])  # 5 levels > 4 layers
    assert code == 2
    assert "levels" in capsys.readouterr().err


def test_a_shard_source_hands_each_position_its_own_shuffled_window(
    dipaco_run: SimulationResult,
) -> None:
    seq_len = 16
    source = dipaco_run.data.train_source(0, seq_len, seed=0)
    windows = source.order.numel()
    first = source.batch(0, 2, seq_len)  # the inner loop then advances position by 2
    second = source.batch(2, 1, seq_len)
    whole = torch.from_numpy(source.shard.read_window(0, windows * seq_len + 1))
    for row, position in ((first[1], 1), (second[0], 2)):
        start = int(source.order[position]) * seq_len
        assert torch.equal(row, whole[start : start + seq_len + 1])
    assert sorted(source.order.tolist()) == list(range(windows))
    again = dipaco_run.data.train_source(0, seq_len, seed=0)
    assert torch.equal(again.batch(5, 3, seq_len), source.batch(5, 3, seq_len))


def test_the_base_models_features_route_the_documents_as_in_the_paper(work_dir: Path) -> None:
    config = tiny_config(rounds=1, inner={"steps": 2, "warmup_steps": 1},
                         router={"featurizer": "base-lm"})  # fmt: skip
    options = SimulateOptions(
        budget=BUDGET, work_dir=work_dir, eval_windows=16, baselines=(), base_steps=15
    )
    result = simulate(config, options)
    router = result.data.router
    assert router is not None and router.spec.featurizer == "base-lm"
    tfidf = prepare_data(tiny_config(), BUDGET, work_dir)
    assert result.data.key != tfidf.key  # another sharding, cached apart
    assert sum(result.data.docs("train")) == sum(tfidf.docs("train"))
    with pytest.raises(ValueError, match="base steps"):
        simulate(config, SimulateOptions(budget=BUDGET, work_dir=work_dir, baselines=()))


def test_with_int8_downloads_a_worker_holding_version_t_rebuilds_the_servers_weights_exactly(
    work_dir: Path, dipaco_run: SimulationResult
) -> None:
    """comm.download_codec: each outer update is published encoded; the server's module is
    its old weights plus exactly the decoded update, so a worker that applies the update's
    bytes to version t holds version t + 1 bit for bit, five rounds on; and after round 0
    a unit of `dipaco simulate` downloads only those updates."""
    config = tiny_config(comm={"codec": "int8", "download_codec": "int8"})
    server = init_modules(config)
    worker = {m: {n: t.clone() for n, t in tensors.items()} for m, tensors in server.items()}
    residual: dict[str, dict[str, torch.Tensor]] = {}
    generator = torch.Generator().manual_seed(0)
    fp32 = sum(4 * t.numel() for tensors in server.values() for t in tensors.values())
    for _ in range(5):
        sent = 0
        for module_id, old in list(server.items()):  # an outer step moves every module
            new = {n: t - 0.01 * torch.randn(t.shape, generator=generator) for n, t in old.items()}
            server[module_id], data, residual[module_id] = publish_update(
                old, new, "int8", residual.get(module_id), block_size=64
            )
            worker[module_id] = apply_update(worker[module_id], data)  # the bytes only
            sent += len(data)
        assert sent < fp32 / 3, "int8 updates, not fp32 modules"
        for module_id, tensors in server.items():
            for name, tensor in tensors.items():
                assert torch.equal(worker[module_id][name], tensor), (module_id, name)
    options = SimulateOptions(budget=BUDGET, work_dir=work_dir, eval_windows=32)
    result = simulate(config, options)
    path_fp32 = 4 * config.num_params()
    first, *later = result.run.rounds[1:]
    assert first.download_bytes == config.num_paths * path_fp32  # new workers: whole modules
    for record in later:  # then encoded updates only: int8 plus block scales and headers
        assert 0 < record.download_bytes < config.num_paths * path_fp32 / 3
    assert math.isfinite(result.loss) and result.loss == pytest.approx(dipaco_run.loss, rel=0.05)


def test_validating_every_other_round_keeps_the_weights_bytes_and_last_loss(
    work_dir: Path, dipaco_run: SimulationResult
) -> None:
    options = SimulateOptions(
        budget=BUDGET, work_dir=work_dir, eval_windows=32, baselines=(), eval_every=2
    )
    sparse = simulate(tiny_config(), options)
    assert [r.round for r in sparse.run.rounds] == [0, 2, 3]  # and always the last
    assert sparse.run.rounds[-1].routed_loss == dipaco_run.run.rounds[-1].routed_loss
    assert sparse.run.upload_bytes == dipaco_run.run.upload_bytes
    with pytest.raises(ValueError, match="eval_every"):
        simulate(tiny_config(), SimulateOptions(budget=BUDGET, work_dir=work_dir, eval_every=0))

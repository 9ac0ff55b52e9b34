"""Run configuration: loading the examples, one-line errors, overrides, sizes, tagged unions."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flotilla.config import (
    AdamOptimizer,
    AllReduceStrategy,
    RunConfig,
    SGDOptimizer,
    WorkerSpec,
    apply_overrides,
    format_size,
    format_validation_error,
    load_config,
    parse_size,
    validate_config,
)
from flotilla.core.errors import ConfigError
from flotilla.ps.config import DeltaUpdate, ServerSGD
from flotilla.ps.consistency import ASP, BSP, SSP, WSP
from flotilla.sync.ps_settings import ps_config_from

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DEMO, TINY = EXAMPLES / "demo.yaml", EXAMPLES / "tiny.yaml"
GiB, MiB = 2**30, 2**20

MINIMAL = """
cluster: {num_workers: 2}
job: {model: {name: mlp}, dataset: {name: synthetic}, steps: 5}
"""


def config_error(*overrides: str, path: Path = TINY, text: str | None = None) -> str:
    """The message of the ConfigError raised by loading; asserts it is one line."""
    with pytest.raises(ConfigError) as info:
        if text is not None:
            load_config(None, overrides, text=text)
        else:
            load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    # No chained pydantic/YAML traceback is printed under the one line.
    assert info.value.__cause__ is None
    assert info.value.__context__ is None or info.value.__suppress_context__
    return message


# ------------------------------------------------------------------------------------ examples


def test_demo_example_loads_with_resolved_workers() -> None:
    cfg = load_config(DEMO)
    workers = cfg.cluster.resolved_workers()
    assert workers == [
        WorkerSpec(name=f"w{i}", speed=s, memory_bytes=8 * GiB) for i, s in enumerate([1.0, 1.0, 1.0, 0.5])
    ]
    assert cfg.cluster.effective_min_workers() == 4
    assert cfg.cluster.host == "127.0.0.1"
    assert (cfg.job.model.name, cfg.job.dataset.name) == ("cnn1d", "mnist1d")
    assert (cfg.job.dataset.num_samples, cfg.job.dataset.test_fraction) == (25000, 0.2)
    assert cfg.job.optimizer == SGDOptimizer(lr=0.05, momentum=0.9)
    assert (cfg.job.batch_size, cfg.job.epochs, cfg.job.steps) == (128, 8, None)
    assert (cfg.job.seed, cfg.job.eval_every_steps) == (0, 200)
    assert cfg.strategy == AllReduceStrategy(bucket_bytes=4 * MiB, step_timeout_s=30.0, on_abort="redo")
    assert cfg.report.metrics_every_steps == 1


def test_tiny_example_loads() -> None:
    cfg = load_config(str(TINY))
    assert [w.name for w in cfg.cluster.resolved_workers()] == ["w0", "w1"]
    assert {w.memory_bytes for w in cfg.cluster.resolved_workers()} == {GiB}
    assert (cfg.job.model.name, cfg.job.dataset.name) == ("tiny_mlp", "synthetic")
    assert (cfg.job.dataset.num_samples, cfg.job.steps, cfg.job.epochs) == (2000, 30, None)


def test_precision_takes_fp32_bf16_fp16_and_names_them_when_refused() -> None:
    for value in ("fp32", "bf16", "fp16"):
        assert load_config(str(TINY), [f"job.precision={value}"]).job.precision == value
    msg = config_error("job.precision=fp8")
    assert msg == "job.precision: unknown 'fp8'; allowed: fp32, bf16, fp16"


def test_fp16_takes_flushing_pipelines_and_refuses_pipedream_and_hetpipe_in_one_line() -> None:
    pipe = EXAMPLES / "pipeline_lm.yaml"
    for schedule in ("gpipe", "1f1b"):
        cfg = load_config(pipe, ["job.precision=fp16", f"strategy.schedule={schedule}"])
        assert (cfg.job.precision, cfg.strategy.schedule) == ("fp16", schedule)
    msg = config_error("job.precision=fp16", "strategy.schedule=pipedream", path=pipe)
    assert msg.startswith("job.precision: fp16 is not built for strategy pipeline with schedule pipedream")
    assert "pipeline with schedule gpipe or 1f1b" in msg and "use bf16" in msg
    assert load_config(pipe, ["job.precision=bf16", "strategy.schedule=pipedream"]).job.precision == "bf16"
    msg = config_error("job.precision=fp16", path=EXAMPLES / "hetpipe.yaml")
    assert msg.startswith("job.precision: fp16 is not built for strategy hetpipe with schedule pipedream")


def test_to_dict_is_json_with_int_sizes_and_round_trips() -> None:
    cfg = load_config(DEMO)
    data = cfg.to_dict()
    assert data["strategy"]["bucket_bytes"] == 4 * MiB
    assert data["cluster"]["defaults"]["memory_bytes"] == 8 * GiB
    assert isinstance(data["cluster"]["workers"], list)
    assert validate_config(data) == cfg


def test_defaults_of_minimal_config() -> None:
    cfg = load_config(text=MINIMAL)
    assert cfg.strategy == AllReduceStrategy()
    assert cfg.job.optimizer == SGDOptimizer()
    assert cfg.cluster.resolved_workers() == [
        WorkerSpec(name="w0", speed=1.0, memory_bytes=8 * GiB),
        WorkerSpec(name="w1", speed=1.0, memory_bytes=8 * GiB),
    ]


def test_workers_mix_entries_and_defaults() -> None:
    cfg = load_config(
        TINY,
        [
            "cluster.num_workers=null",
            "cluster.min_workers=1",
            "cluster.workers=[{name: a, speed: 0.75}, {memory_bytes: 512MiB}]",
        ],
    )
    assert cfg.cluster.resolved_workers() == [
        WorkerSpec(name="a", speed=0.75, memory_bytes=GiB),
        WorkerSpec(name="w1", speed=1.0, memory_bytes=512 * MiB),
    ]
    assert cfg.cluster.effective_min_workers() == 1


def test_models_are_frozen_and_hashable() -> None:
    cfg = load_config(DEMO)
    with pytest.raises(pydantic.ValidationError):
        cfg.job.steps = 5  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cfg.cluster.workers.append(None)  # type: ignore[union-attr]
    assert hash(cfg) == hash(load_config(DEMO))


# ------------------------------------------------------------------------------- value errors


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["job.optimizer.lr=-1"], "job.optimizer.lr: must be > 0 (got -1)"),
        (
            ["cluster.workers=[{speed: 1}, {sped: 0.5}]", "cluster.num_workers=null"],
            "cluster.workers.1.sped: unknown key; allowed: device, memory_bytes, name, node, slowdown, "
            "speed, type",
        ),
        (
            ["strategy.kind=foo"],
            "strategy.kind: unknown 'foo'; allowed: adaptive, adpsgd, allreduce, diloco, hetpipe, "
            "partial_reduce, pipeline, ps "
            "(or an import name: './my_strategy.py:SPEC', 'package.module:SPEC')",
        ),
        (
            ["strategy={bucket_bytes: 5}"],
            "strategy.kind: missing; allowed: adaptive, adpsgd, allreduce, diloco, hetpipe, partial_reduce, "
            "pipeline, ps "
            "(or an import name)",
        ),
        (
            ["strategy.bucket_byts=5"],
            "override 'strategy.bucket_byts=5': strategy.bucket_byts: unknown key; "
            # (the fields of the file's kind)
            "allowed: bucket_bytes, grad_dtype, kind, on_abort, step_timeout_s",
        ),
        (
            ["job.model.name=resnet"],
            "job.model.name: unknown 'resnet'; allowed: cnn1d, mlp, tiny_mlp, char_transformer",
        ),
        (
            ["job.model={}"],
            "job.model.name: missing (required); allowed: cnn1d, mlp, tiny_mlp, char_transformer",
        ),
        (
            ["job.dataset.name=cifar"],
            "job.dataset.name: unknown 'cifar'; allowed: mnist1d, synthetic, pysource",
        ),
        (["strategy.on_abort=retry"], "strategy.on_abort: unknown 'retry'; allowed: redo, drop"),
        (["strategy.step_timeout_s=0"], "strategy.step_timeout_s: must be > 0 (got 0)"),
        (["strategy.step_timeout_s=fast"], "strategy.step_timeout_s: must be a number (got 'fast')"),
        (["strategy.bucket_bytes=0"], "strategy.bucket_bytes: must be > 0 (got 0)"),
        (["cluster.defaults.speed=2"], "cluster.defaults.speed: must be <= 1 (got 2)"),
        (["cluster.defaults.speed=0"], "cluster.defaults.speed: must be > 0 (got 0)"),
        (["cluster.defaults.memory_bytes=-1"], "cluster.defaults.memory_bytes: must be > 0 (got -1)"),
        (["job.batch_size=0"], "job.batch_size: must be >= 1 (got 0)"),
        (["job.batch_size=1"], "job.batch_size: must be >= the number of workers (2) (got 1)"),
        (["job.seed=abc"], "job.seed: must be an integer (got 'abc')"),
        (["job.optimizer.lr=.inf"], "job.optimizer.lr: must be a finite number (got inf)"),
        (["job.optimizer.nesterov=maybe"], "job.optimizer.nesterov: must be true or false (got 'maybe')"),
        (
            ["job.optimizer.momentum=0", "job.optimizer.nesterov=true"],
            "job.optimizer.nesterov: needs momentum > 0 (got momentum=0)",
        ),
        (["job.optimizer={kind: adam, betas: [0.9, 1.5]}"], "job.optimizer.betas.1: must be < 1 (got 1.5)"),
        (
            ["job.optimizer={kind: adam, betas: [0.9]}"],
            "job.optimizer.betas: must have exactly 2 items (got a list of 1)",
        ),
        (
            ["job.optimizer={kind: rmsprop}"],
            "job.optimizer.kind: unknown 'rmsprop'; allowed: sgd, adam, adamw",
        ),
        (
            ["job.optimizer.kind=adam"],
            "job.optimizer.momentum: unknown key; allowed: betas, clip_grad_norm, eps, kind, lr, "
            "weight_decay, weight_decay_on (--set job.optimizer.kind keeps the section's other keys: "
            "replace the whole section instead, e.g. --set 'job.optimizer={kind: adam}')",
        ),
        (["job.dataset.test_fraction=1"], "job.dataset.test_fraction: must be < 1 (got 1)"),
        (
            ["job.dataset.test_fraction=1e-17"],
            "job.dataset.test_fraction: leaves 2000 of 2000 samples for training; "
            "train and test must both be non-empty",
        ),
        (
            ["job.dataset.test_fraction=0.99", "job.dataset.num_samples=10"],
            "job.dataset.test_fraction: leaves 0 of 10 samples for training; "
            "train and test must both be non-empty",
        ),
        (["job.dataset.num_samples=9"], "job.dataset.num_samples: must be >= 10 (got 9)"),
        (["report.metrics_every_steps=0"], "report.metrics_every_steps: must be >= 1 (got 0)"),
        (["job.eval_every_steps=-1"], "job.eval_every_steps: must be >= 0 (got -1)"),
        (
            ["cluster=5"],
            "cluster: must be a mapping with keys defaults, heartbeat_timeout_s, host, links, min_workers, "
            "num_workers, peer_heartbeat_s, revocations, workers (got 5)",
        ),
        (["cluster.host=bad host"], "cluster.host: must be a host name or an IP address (got 'bad host')"),
        (["cluster.min_workers=3"], "cluster.min_workers: must be <= the number of workers (2) (got 3)"),
        (["cluster.num_workers=null"], "cluster.workers: set one of workers, num_workers"),
        (
            ["cluster.workers=[{}, {}, {}]"],
            "cluster.num_workers: must equal the length of workers (3) when both are set (got 2)",
        ),
        (
            ["cluster.workers=[{name: w1}, {}]"],
            "cluster.workers: duplicate worker names ['w1'] (unnamed entry i is 'w<i>')",
        ),
        (
            ["cluster.workers=[{name: 'a b'}, {}]"],
            "cluster.workers.0.name: must be 1-64 letters, digits, '_', '-' or '.' (got 'a b')",
        ),
        (
            ["cluster.workers=[]", "cluster.num_workers=null"],
            "cluster.workers: must have at least 1 item (got a list of 0)",
        ),
    ],
)
def test_bad_values_give_one_line_naming_field_and_allowed(overrides: list[str], expected: str) -> None:
    assert config_error(*overrides) == expected


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["job.epochs=3"],
            "job: exactly one of steps, epochs must be set (got steps=30, epochs=3; set the other to null)",
        ),
        (
            ["job.steps=null"],
            "job: exactly one of steps, epochs must be set (got neither; set the other to null)",
        ),
    ],
)
def test_steps_and_epochs_are_exclusive(overrides: list[str], expected: str) -> None:
    assert config_error(*overrides) == expected
    cfg = load_config(TINY, ["job.steps=null", "job.epochs=2"])
    assert (cfg.job.steps, cfg.job.epochs) == (None, 2)


def test_several_problems_joined_on_one_line() -> None:
    message = config_error("job.seed=-1", "job.batch_size=0")
    assert message == ("job.batch_size: must be >= 1 (got 0); job.seed: must be >= 0 (got -1)")
    assert config_error(text="") == "cluster: missing (required); job: missing (required)"


def test_format_validation_error_directly() -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        AdamOptimizer.model_validate({"kind": "adam", "eps": 0})
    # A model validated outside RunConfig: the path is relative to that model.
    assert format_validation_error(info.value) == "eps: must be > 0 (got 0)"
    with pytest.raises(pydantic.ValidationError) as info:
        RunConfig.model_validate({"cluster": {"num_workers": 1, "nodes": 2}})
    assert format_validation_error(info.value) == (
        "cluster.nodes: unknown key; allowed: defaults, heartbeat_timeout_s, host, links, min_workers, "
        "num_workers, peer_heartbeat_s, revocations, workers; "
        "job: missing (required)"
    )


# ------------------------------------------------------------------------- file / YAML errors


def test_unknown_top_level_section_lists_sections() -> None:
    assert config_error(text=MINIMAL + "sched: {x: 1}\n") == (
        "sched: unknown section; allowed: checkpoint, cluster, job, report, strategy"
    )


def test_yaml_syntax_error_names_position() -> None:
    assert config_error(text="cluster: [\n") == (
        "<text>:2:1: invalid YAML: expected the node content, but found '<stream end>'"
    )


def test_duplicate_yaml_key_is_refused() -> None:
    assert config_error(text=MINIMAL + "job: {}\n") == ("<text>:4:1: invalid YAML: duplicate key 'job'")


def test_top_level_must_be_mapping() -> None:
    assert config_error(text="- 1\n- 2\n") == (
        "<text>: top level must be a mapping with sections cluster, job, strategy, report, "
        "checkpoint (got a list of 2)"
    )


def test_missing_file_and_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    assert config_error(path=missing) == f"{missing}: no such config file"
    assert config_error(path=tmp_path).startswith(f"{tmp_path}: cannot read config (")


def test_file_path_is_named_in_yaml_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: {num_workers: 2\n")
    assert config_error(path=bad).startswith(f"{bad}:2:1: invalid YAML: ")


# ------------------------------------------------------------------------------------ overrides


def test_override_scalar_nested_list_index_and_flow_list() -> None:
    cfg = load_config(
        DEMO,
        [
            "job.steps=50",
            "job.epochs=null",
            "strategy.kind=allreduce",
            "strategy.bucket_bytes=1MiB",
            "cluster.workers.1.speed=0.25",
            "job.optimizer.lr=1e-3",
        ],
    )
    assert (cfg.job.steps, cfg.job.epochs, cfg.job.optimizer.lr) == (50, None, 1e-3)
    assert cfg.strategy.bucket_bytes == MiB
    assert [w.speed for w in cfg.cluster.resolved_workers()] == [1.0, 0.25, 1.0, 0.5]
    cfg = load_config(DEMO, ["cluster.workers=[{speed: 1}, {speed: 0.5}]"])
    assert [(w.name, w.speed) for w in cfg.cluster.resolved_workers()] == [("w0", 1.0), ("w1", 0.5)]


def test_overrides_apply_in_order_and_create_sections() -> None:
    cfg = load_config(
        None,
        [
            "cluster.num_workers=3",
            "job.model.name=mlp",
            "job.model.width=16",
            "job.dataset={name: synthetic}",
            "job.steps=1",
            "job.steps=7",
        ],
    )
    assert (cfg.cluster.effective_num_workers(), cfg.job.steps, cfg.job.model.width) == (3, 7, 16)


def test_apply_overrides_does_not_mutate_input() -> None:
    data = {"job": {"steps": 1, "model": {"name": "mlp"}}}
    result = apply_overrides(data, ["job.model.name=cnn1d", "report.metrics_every_steps=4"])
    assert data == {"job": {"steps": 1, "model": {"name": "mlp"}}}
    assert result == {"job": {"steps": 1, "model": {"name": "cnn1d"}}, "report": {"metrics_every_steps": 4}}
    assert apply_overrides({}, "job.seed=3") == {"job": {"seed": 3}}


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("jobsteps", "override 'jobsteps': expected PATH=VALUE, e.g. job.steps=50"),
        ("job..steps=1", "override 'job..steps=1': empty component in path 'job..steps'"),
        (
            "job.stepz=5",
            "override 'job.stepz=5': job.stepz: unknown key; allowed: accumulate, auto_checkpoint, "
            "batch_size, compile, compile_backend, dataset, epochs, eval_every_steps, max_nonfinite, "
            "max_restarts, model, nonfinite, on_error, optimizer, precision, schedule, seed, steps, task, "
            "task_args",
        ),
        (
            "jbo.steps=5",
            "override 'jbo.steps=5': jbo: unknown section; "
            "allowed: checkpoint, cluster, job, report, strategy",
        ),
        (
            "job.steps.x=1",
            "override 'job.steps.x=1': job.steps.x: unknown key; job.steps is a value, not a section",
        ),
        (
            "cluster.workers.x.speed=1",
            "override 'cluster.workers.x.speed=1': cluster.workers.x: expected a list index (0, 1, ...)",
        ),
        (
            "cluster.workers.0.speed=1",
            "override 'cluster.workers.0.speed=1': cluster.workers is not set; cannot index it",
        ),
        (
            "job.steps=[1",
            "override 'job.steps=[1': value is not valid YAML (expected ',' or ']', but got '<stream end>')",
        ),
    ],
)
def test_bad_overrides(override: str, expected: str) -> None:
    assert config_error(override) == expected


def test_override_list_index_out_of_range() -> None:
    assert config_error("cluster.workers.4.speed=1", path=DEMO) == (
        "override 'cluster.workers.4.speed=1': cluster.workers.4: index out of range (the list has 4 items)"
    )


def test_override_into_a_scalar_in_the_data() -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides({"cluster": 5}, ["cluster.defaults.speed=2"])
    assert str(info.value) == ("override 'cluster.defaults.speed=2': cluster is 5, not a mapping or list")


# ---------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("100B", 100),
        ("100kB", 100_000),
        ("512MiB", 512 * MiB),
        ("4GiB", 4 * GiB),
        ("1.5GB", 1_500_000_000),
        ("1.5KiB", 1536),
        ("2 TiB", 2 * 2**40),
        ("3TB", 3 * 10**12),
        (" 7MB ", 7_000_000),
        ("0.5MiB", MiB // 2),
        (8.0, 8),
    ],
)
def test_parse_size_table(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["4 gb", "4KB", "1e9", "MiB", "-1MiB", "1.5.0", True, None, [1]])
def test_parse_size_rejects_with_accepted_forms(text: object) -> None:
    forms = r"expected an int or a string like '512MiB'.*units: B, kB"
    with pytest.raises(ConfigError, match=forms):
        parse_size(text)


def test_parse_size_rejects_fractional_bytes() -> None:
    with pytest.raises(ConfigError, match="is not a whole number of bytes"):
        parse_size("1.5B")


def test_bad_size_in_config_names_field_and_forms() -> None:
    assert config_error("cluster.defaults.memory_bytes=4 gb") == (
        "cluster.defaults.memory_bytes: expected an int or a string like '512MiB', '4GiB', "
        "'1.5GB', '100kB' (units: B, kB, MB, GB, TB, KiB, MiB, GiB, TiB) (got '4 gb')"
    )
    assert config_error("strategy.bucket_bytes=2PiB").startswith("strategy.bucket_bytes: expected")


@given(st.integers(min_value=1, max_value=2**50))
def test_format_size_round_trips(num_bytes: int) -> None:
    assert parse_size(format_size(num_bytes)) == num_bytes


def test_format_size_prefers_largest_exact_unit() -> None:
    assert [format_size(n) for n in (4 * MiB, 3072, 1_500_000_000, 1536, 7, 5 * GiB)] == [
        "4MiB",
        "3KiB",
        "1500MB",
        "1536B",
        "7B",
        "5GiB",
    ]


# ------------------------------------------------------------------------ strategy union / API


def test_strategy_discriminator_selects_model() -> None:
    cfg = load_config(TINY, ["strategy={kind: allreduce, on_abort: drop}"])
    assert isinstance(cfg.strategy, AllReduceStrategy) and cfg.strategy.on_abort == "drop"
    cfg = load_config(TINY, ["job.optimizer={kind: adam, lr: 0.01, betas: [0.8, 0.9]}"])
    assert cfg.job.optimizer == AdamOptimizer(lr=0.01, betas=(0.8, 0.9))


def test_null_revocations_or_links_mean_none_over_an_example_that_has_some() -> None:
    spot = EXAMPLES / "spot.yaml"
    assert load_config(spot).cluster.revocations.active
    for value in ("null", "{}"):
        cfg = load_config(spot, [f"cluster.revocations={value}", "cluster.links=null"])
        assert not cfg.cluster.revocations.active and cfg.cluster.links == load_config(TINY).cluster.links


def test_a_kind_changed_by_set_that_leaves_unknown_keys_says_to_replace_the_section() -> None:
    adpsgd = EXAMPLES / "adpsgd.yaml"
    message = config_error("strategy.kind=allreduce", path=adpsgd)
    assert "strategy.exchange_timeout_s: unknown key" in message
    assert message.endswith("e.g. --set 'strategy={kind: allreduce}')"), message
    assert "replace the whole" not in config_error("strategy.exchange_timeout_s=0", path=adpsgd)
    assert load_config(adpsgd, ["strategy={kind: allreduce}"]).strategy.kind == "allreduce"


def test_load_config_rejects_path_and_text_together() -> None:
    with pytest.raises(TypeError):
        load_config(TINY, text=MINIMAL)


def test_run_config_is_the_root_model() -> None:
    assert list(RunConfig.model_fields) == ["cluster", "job", "strategy", "report", "checkpoint"]


# ------------------------------------------------------------------- tagged ps consistency (DESIGN §5)

PS_CONSISTENCY = [
    ("{kind: bsp}", BSP()),
    ("{kind: asp}", ASP()),
    ("{kind: ssp, staleness: 5}", SSP(staleness=5)),
    ("{kind: ssp}", SSP(staleness=3)),
    ("{kind: wsp, s_local: 2, clock_distance: 1}", WSP(s_local=2, clock_distance=1)),
]


@pytest.mark.parametrize(("spelled", "model"), PS_CONSISTENCY)
def test_tagged_consistency_becomes_the_ps_package_config(spelled: str, model) -> None:
    cfg = load_config(TINY, [f"strategy={{kind: ps, update: delta, consistency: {spelled}}}"])
    assert ps_config_from(cfg.strategy, cfg.job.optimizer).consistency == model


@pytest.mark.parametrize(
    ("overrides", "model"),
    [
        (["strategy={kind: ps, consistency: bsp}"], BSP()),
        (["strategy={kind: ps, consistency: asp, staleness: 2}"], ASP()),
        (["strategy={kind: ps, consistency: ssp, staleness: 2}"], SSP(staleness=2)),
        (["strategy={kind: ps, staleness: 7}"], SSP(staleness=7)),
        (["strategy={kind: ps}"], SSP(staleness=3)),
        (
            [
                "strategy={kind: ps, update: delta, consistency: wsp, "
                + "staleness: 2, s_local: 1, clock_distance: 4}"
            ],
            WSP(s_local=1, clock_distance=4),
        ),
        # --set on either spelling: a loose field overrides the tagged one of the same kind
        (
            ["strategy={kind: ps, consistency: {kind: ssp, staleness: 3}}", "strategy.staleness=6"],
            SSP(staleness=6),
        ),
        (["strategy={kind: ps, consistency: {kind: ssp, staleness: 3}}", "strategy.consistency=bsp"], BSP()),
        (
            ["strategy={kind: ps, consistency: {kind: ssp}}", "strategy.consistency.staleness=1"],
            SSP(staleness=1),
        ),
    ],
)
def test_old_consistency_spelling_still_works(overrides: list[str], model) -> None:
    cfg = load_config(TINY, overrides)
    assert ps_config_from(cfg.strategy, cfg.job.optimizer).consistency == model


def test_example_uses_the_tagged_spelling() -> None:
    cfg = load_config(EXAMPLES / "ps_ssp.yaml")
    assert cfg.strategy.consistency.kind == "ssp" and cfg.strategy.consistency.staleness == 3
    ps = ps_config_from(cfg.strategy, cfg.job.optimizer)
    assert ps.consistency == SSP(staleness=3) and ps.update == ServerSGD(lr=0.05, momentum=0.9)
    assert (ps.num_servers, ps.read_mode, ps.pull_timeout_s) == (2, "plain", 60.0)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["strategy={kind: ps, consistency: {kind: ssp, staleness: -1}}"],
            "strategy.consistency.staleness: must be >= 0 (got -1)",
        ),
        (
            ["strategy={kind: ps, consistency: foo}"],
            "strategy.consistency.kind: unknown 'foo'; allowed: bsp, asp, ssp, wsp",
        ),
        (
            ["strategy={kind: ps, consistency: {kind: wsp, staleness: 2}}"],
            "strategy.consistency.staleness: unknown key; allowed: clock_distance, kind, s_local",
        ),
        (
            ["strategy={kind: ps, consistency: {staleness: 2}}"],
            "strategy.consistency.kind: missing; allowed: bsp, asp, ssp, wsp",
        ),
        (
            ["strategy={kind: ps, consistency: {kind: wsp, s_local: 65}}"],
            "strategy.consistency.s_local: must be <= 64 (got 65)",
        ),
    ],
)
def test_bad_consistency_names_the_field_and_allowed(overrides: list[str], expected: str) -> None:
    assert config_error(*overrides) == expected


def test_ps_config_from_checks_the_update_rule_and_read_mode() -> None:
    with pytest.raises(ConfigError, match="strategy.update: must be 'delta'"):  # refused at validation
        load_config(TINY, ["strategy={kind: ps, consistency: {kind: wsp, s_local: 2}}"])
    cfg = load_config(TINY, ["strategy={kind: ps, update: delta, consistency: {kind: wsp, s_local: 2}}"])
    with pytest.raises(ConfigError, match="strategy.update: must be 'delta'"):
        ps_config_from(cfg.strategy.model_copy(update={"update": "server_sgd"}), cfg.job.optimizer)
    cfg = load_config(
        TINY, ["strategy={kind: ps, update: delta, read_ahead: true}", "job.optimizer={kind: adam}"]
    )
    ps = ps_config_from(cfg.strategy, cfg.job.optimizer)
    assert ps.update == DeltaUpdate() and ps.read_mode == "read_ahead" and ps.read_ahead
    with pytest.raises(ConfigError, match="needs job.optimizer.kind 'sgd'"):
        ps_config_from(cfg.strategy.model_copy(update={"update": "server_sgd"}), cfg.job.optimizer)


def test_job_on_error_takes_stop_or_lose_worker_and_leaves_the_fingerprint_alone(tmp_path: Path) -> None:
    """``job.on_error`` (``docs/tasks.md``): the default is left out of dumps and fingerprints
    (a checkpoint written before it existed stays resumable); a wrong value names the field."""
    path = tmp_path / "c.yaml"
    path.write_text(Path("examples/demo.yaml").read_text())
    base = load_config(path)
    lose = load_config(path, ["job.on_error=lose_worker"])
    assert base.job.on_error == "stop" and "on_error" not in base.to_dict()["job"]
    assert lose.fingerprint() == base.fingerprint()
    with pytest.raises(ConfigError, match=r"job\.on_error: unknown 'crash'; allowed: stop, lose_worker"):
        load_config(path, ["job.on_error=crash"])

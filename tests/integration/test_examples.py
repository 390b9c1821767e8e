"""The example training runs: every precision trains, policies are applied, faults are
skipped, fp16 underflows without loss scaling, and (slow) mixed precision matches fp32."""

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpjax
from examples import common, train_char_lm, train_digits, underflow_demo

ROOT = Path(__file__).resolve().parents[2]
ALL_PRECISIONS = list(common.PRECISIONS)
TINY_DIGITS = dict(steps=50, batch_size=64, width=16, num_blocks=1, learning_rate=2e-2)
TINY_LM = dict(
    steps=30, batch_size=16, seq_len=32, d_model=32, num_layers=1, num_heads=2, eval_windows=8
)


@pytest.fixture(scope="module")
def digits():
    return train_digits.load_data()


@pytest.fixture(scope="module")
def corpus():
    return train_char_lm.load_corpus(max_bytes=200_000)


def _decreased(loss: np.ndarray, factor: float) -> bool:
    first, last = loss[:5].mean(), loss[-5:].mean()
    return bool(np.isfinite(last) and last < factor * first)


def _sub_jaxprs(value):
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        yield value.jaxpr
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _sub_jaxprs(v)


def _matmul_dtypes(jaxpr) -> set:
    """Operand dtypes of every conv and matmul in a jaxpr, nested jaxprs included."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("conv_general_dilated", "dot_general"):
            found.update(v.aval.dtype for v in eqn.invars)
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                found |= _matmul_dtypes(sub)
    return found


# --- digits -------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ALL_PRECISIONS)
def test_digits_trains_end_to_end(precision, digits):
    config = train_digits.DigitsConfig(precision=precision, **TINY_DIGITS)
    run = train_digits.train(config, seed=1, data=digits)
    assert run.history["loss"].shape == (config.steps,)
    assert np.all(np.isfinite(run.history["loss"]))
    assert _decreased(run.history["loss"], 0.8), run.history["loss"]
    assert run.skipped_steps == 0
    assert 0.0 <= run.metric <= 100.0 and run.metric > 30.0  # well above chance (10%)
    # Parameters stay float32 (the policy's param dtype), batch statistics too.
    for leaf in jax.tree.leaves((run.params, run.extra["batch_stats"])):
        assert leaf.dtype == jnp.float32
    if precision == "fp16":
        assert run.history["loss_scale"][0] == config.initial_scale
    else:
        assert np.all(run.history["loss_scale"] == 1.0)


@pytest.mark.parametrize(
    "precision,compute", [("fp32", jnp.float32), ("bf16", jnp.bfloat16), ("fp16", jnp.float16)]
)
def test_digits_model_runs_under_policy(precision, compute, digits):
    config = train_digits.DigitsConfig(precision=precision, width=8, num_blocks=1)
    model = train_digits.build_model(config)
    x = digits.x_train[:4]
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    assert {leaf.dtype for leaf in jax.tree.leaves(variables)} == {jnp.dtype(jnp.float32)}
    closed = jax.make_jaxpr(lambda v: model.apply(v, x))(variables)
    assert _matmul_dtypes(closed.jaxpr) == {jnp.dtype(compute)}
    assert [v.aval.dtype for v in closed.jaxpr.outvars] == [jnp.float32]


def test_digits_fault_hooks_skip_the_faulty_steps(digits):
    config = train_digits.DigitsConfig(precision="fp16", **dict(TINY_DIGITS, steps=12))
    nan_step, inf_step = 3, 7

    def batch_fault(step, batch):
        x, y = batch
        if step == nan_step:
            x = x.copy()
            x[0, 0, 0, 0] = np.nan
        return x, y

    def grad_fault(step, grads):
        return jax.tree.map(lambda g: jnp.where(step == inf_step, g * jnp.inf, g), grads)

    run = train_digits.train(
        config, seed=0, data=digits, batch_fault=batch_fault, grad_fault=grad_fault
    )
    finite = run.history["grads_finite"]
    assert np.flatnonzero(~finite).tolist() == [nan_step, inf_step]
    assert run.skipped_steps == 2
    # A skipped step neither poisons the weights nor the BatchNorm statistics.
    for leaf in jax.tree.leaves((run.params, run.extra["batch_stats"])):
        assert np.all(np.isfinite(leaf))
    scale = run.history["loss_scale"]
    assert scale[nan_step] == scale[nan_step - 1] / 2
    assert scale[inf_step] == scale[inf_step - 1] / 2


@pytest.mark.parametrize("precision", ["fp16", "fp16-noscale"])
def test_digits_dead_run_stops_unless_skipping_is_the_point(precision, digits):
    config = train_digits.DigitsConfig(precision=precision, **TINY_DIGITS)  # 50 steps

    def grad_fault(step, grads):  # every step non-finite: a dead run
        return jax.tree.map(lambda g: g * jnp.nan, grads)

    def run():
        return train_digits.train(config, seed=0, data=digits, grad_fault=grad_fault)

    if precision == "fp16":  # 49 skips in a row is the default limit: checked at step 50
        with pytest.raises(mpjax.TrainingDivergedError, match="50 non-finite steps in a row"):
            run()
    else:  # the no-scaling ablation skips by design and runs to the end
        assert run().skipped_steps == config.steps


@pytest.mark.parametrize("optimizer_state", ["f32", "bf16", "bf16-nearest"])
def test_digits_optimizer_state_flag_stores_adam_moments(
    optimizer_state, digits, tmp_path, monkeypatch
):
    monkeypatch.setattr(train_digits, "load_data", lambda: digits)
    argv = ["--precisions", "bf16", "--seeds", "1", "--steps", "50", "--lr", "2e-2"]
    argv += ["--width", "16", "--blocks", "1", "--no-progress", "--png", str(tmp_path / "d.png")]
    (run,) = train_digits.main([*argv, "--optimizer-state", optimizer_state])
    inner = run.opt_state.inner_state
    low = optimizer_state != "f32"
    assert isinstance(inner, mpjax.scaling.LowPrecisionState) == low
    want = jnp.bfloat16 if low else jnp.float32
    moments = [optax.tree_utils.tree_get(inner, name) for name in ("mu", "nu")]
    for leaf in jax.tree.leaves(moments):
        assert leaf.dtype == want
    assert len(jax.tree.leaves(moments)) == 2 * len(jax.tree.leaves(run.params))
    # The params stay float32: loss_scaled keeps no master copy.
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(run.params))
    assert not jax.tree.leaves(run.opt_state.master)
    assert _decreased(run.history["loss"], 0.8), run.history["loss"]
    assert run.metric > 30.0  # well above chance (10%)


def test_digits_config_rejects_bad_values():
    with pytest.raises(ValueError, match="precision"):
        train_digits.DigitsConfig(precision="fp8")
    with pytest.raises(ValueError, match="steps"):
        train_digits.DigitsConfig(steps=0)
    with pytest.raises(ValueError, match="loss_multiplier"):
        train_digits.DigitsConfig(loss_multiplier=0.0)
    with pytest.raises(ValueError, match="optimizer_state"):
        train_digits.DigitsConfig(optimizer_state="fp8")


# --- char LM ------------------------------------------------------------------------------


def test_corpus_is_the_standard_library(corpus):
    root = Path(sysconfig.get_paths()["stdlib"])
    assert list(corpus.files) == [p.name for p in sorted(root.glob("*.py"))][: len(corpus.files)]
    first = (root / corpus.files[0]).read_bytes()[:1000]
    assert bytes(corpus.train[: len(first)]) == first
    assert len(corpus.train) + len(corpus.val) == 200_000
    assert len(corpus.val) == 20_000


@pytest.mark.parametrize("precision", ALL_PRECISIONS)
def test_char_lm_trains_end_to_end(precision, corpus):
    config = train_char_lm.CharLMConfig(precision=precision, **TINY_LM)
    run = train_char_lm.train(config, seed=0, corpus=corpus)
    assert run.history["loss"].shape == (config.steps,)
    assert np.all(np.isfinite(run.history["loss"]))
    assert _decreased(run.history["loss"], 0.75), run.history["loss"]
    # Validation bits per byte: finite and well below the 8 bits of a uniform guess.
    assert 0.0 < run.metric < 6.0
    for leaf in jax.tree.leaves(run.params):
        assert leaf.dtype == jnp.float32


@pytest.mark.parametrize(
    "precision,compute", [("fp32", jnp.float32), ("bf16", jnp.bfloat16), ("fp16", jnp.float16)]
)
def test_char_lm_runs_under_autocast(precision, compute):
    config = train_char_lm.CharLMConfig(precision=precision, **TINY_LM)
    model = train_char_lm.CharTransformer(d_model=32, num_layers=1, num_heads=2, max_len=32)
    apply = train_char_lm.apply_precision(model, common.policy_for(config.precision))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 32)), jnp.int32)
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
    assert {leaf.dtype for leaf in jax.tree.leaves(variables)} == {jnp.dtype(jnp.float32)}
    closed = jax.make_jaxpr(lambda v: apply(v, tokens))(variables)
    assert _matmul_dtypes(closed.jaxpr) == {jnp.dtype(compute)}
    assert [v.aval.dtype for v in closed.jaxpr.outvars] == [jnp.float32]


def test_char_lm_experiment_writes_table_and_png(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(train_char_lm, "load_corpus", lambda max_bytes: corpus)
    png = tmp_path / "lm.png"
    runs, table = train_char_lm.run_experiment(
        ["fp32"], 2, png=png, progress=False, **dict(TINY_LM, steps=5)
    )
    assert [(r.precision, r.seed) for r in runs] == [("fp32", 0), ("fp32", 1)]
    lines = table.splitlines()
    assert lines[0].startswith("| precision") and len(lines) == 3
    assert lines[2].startswith("| fp32") and "(n=2)" in lines[2]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("master_weights", ["auto", "remainder"])
def test_char_lm_param_dtype_flag_stores_bf16_params_and_their_master(
    master_weights, corpus, tmp_path, monkeypatch
):
    monkeypatch.setattr(train_char_lm, "load_corpus", lambda max_bytes: corpus)
    argv = ["--precisions", "bf16", "--steps", "30", "--batch-size", "16", "--seq-len", "32"]
    argv += ["--d-model", "32", "--layers", "1", "--heads", "2", "--no-progress"]
    argv += ["--png", str(tmp_path / "lm.png"), "--param-dtype", "bf16"]
    (run,) = train_char_lm.main([*argv, "--master-weights", master_weights])
    assert {p.dtype for p in jax.tree.leaves(run.params)} == {jnp.dtype(jnp.bfloat16)}
    master = jax.tree.leaves(run.opt_state.master)
    assert len(master) == len(jax.tree.leaves(run.params))
    want = jnp.int16 if master_weights == "remainder" else jnp.float32
    assert {m.dtype for m in master} == {jnp.dtype(want)}
    assert _decreased(run.history["loss"], 0.75), run.history["loss"]


def test_char_lm_config_rejects_bad_param_dtype():
    with pytest.raises(ValueError, match="param_dtype"):
        train_char_lm.CharLMConfig(param_dtype="fp16")


# --- underflow ----------------------------------------------------------------------------


def test_fp16_gradients_underflow_without_loss_scaling(digits):
    small = dict(width=8, num_blocks=1)
    m = underflow_demo.DEFAULT_MULTIPLIER
    noscale, noscale_err = underflow_demo.gradient_underflow("fp16-noscale", m, digits, **small)
    scaled, scaled_err = underflow_demo.gradient_underflow(
        "fp16", m, digits, loss_scale=2.0**15, **small
    )
    plain, plain_err = underflow_demo.gradient_underflow("fp16-noscale", 1.0, digits, **small)
    assert noscale > 0.1  # a large share of the gradient flushes to zero...
    assert noscale_err > 0.5
    assert scaled == 0.0 and scaled_err < 2e-2  # ...and loss scaling recovers it
    assert plain == 0.0 and plain_err < 2e-2  # at the natural loss scale nothing flushes


# --- reporting ----------------------------------------------------------------------------


def _fake_run(precision, seed, metric, steps=20):
    rng = np.random.default_rng(seed)
    history = {
        "loss": rng.uniform(0.5, 2.0, steps),
        "loss_scale": np.full(steps, 2.0**15 if precision == "fp16" else 1.0),
        "grads_finite": np.ones(steps, bool),
        "skipped": np.zeros(steps, bool),
        "skipped_steps": np.zeros(steps, np.int32),
    }
    return common.RunResult(precision, seed, metric, history, wall_s=1.5)


def test_summarise_reports_mean_and_std_over_seeds():
    runs = [_fake_run("fp32", s, a) for s, a in enumerate([98.0, 99.0, 97.5])]
    runs += [_fake_run("fp16", 0, 96.25)]
    runs[1].history["skipped_steps"][-1] = 4
    columns, rows = common.summarise(runs, "acc")
    assert columns[0] == "precision" and "acc" in columns[1]
    acc = np.array([98.0, 99.0, 97.5])
    assert rows[0][0] == "fp32"
    assert rows[0][1] == f"{acc.mean():.2f} ± {acc.std(ddof=1):.2f} (n=3)"
    tail = np.concatenate([r.history["loss"][-2:] for r in runs[:3]]).reshape(3, 2).mean(1)
    assert rows[0][2] == f"{tail.mean():.4f}"
    assert rows[0][3] == f"{4 / 3:g}"
    assert rows[0][5] == "4.5"
    assert rows[1][:2] == ["fp16", "96.25 (n=1)"] and rows[1][4] == "2^15"
    assert rows[0][4] == "1"


def test_plot_runs_writes_a_png(tmp_path):
    runs = [_fake_run(p, 0, 90.0) for p in ("fp32", "fp16")]
    runs[1].history["grads_finite"][5] = False
    runs[1].history["skipped"][5] = True
    path = common.plot_runs(runs, tmp_path / "sub" / "x.png", "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_runs_titles_the_scale_panel_by_what_it_plots(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    kept = []
    monkeypatch.setattr(plt, "close", kept.append)  # keep the figure to read its panels
    runs = [_fake_run(p, 0, 90.0) for p in ("fp32", "bf16", "fp16")]
    common.plot_runs(runs, tmp_path / "x.png", "t")
    scale_panel = kept[0].axes[1]
    assert scale_panel.get_title() == "loss scale: fp16"
    labels = [line.get_label() for line in scale_panel.lines]
    assert labels == ["fp16 (seed 0)", "fp32, bf16: no loss scaling (scale 1)"]
    assert np.all(scale_panel.lines[0].get_ydata() == 2.0**15)


@pytest.mark.parametrize("module", [train_digits, train_char_lm, underflow_demo])
def test_help_documents_every_flag(module, capsys):
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    actions = [a for a in module._parser()._actions if a.dest != "help"]
    assert len(actions) >= 4
    for action in actions:
        assert action.help, f"{action.option_strings} has no help text"
        assert action.option_strings[0] in out


# --- slow: the claim itself --------------------------------------------------------------


def _accuracy_table(out: str) -> dict:
    """precision -> (mean test accuracy, seeds) of the table `train_digits.py` prints."""
    rows = re.findall(r"^\| (\S+)\s+\| ([\d.]+) ± [\d.]+ \(n=(\d+)\)", out, flags=re.M)
    return {p: (float(mean), int(n)) for p, mean, n in rows}


@pytest.mark.slow
def test_digits_mixed_precision_matches_fp32(tmp_path):
    """The README's main job, run as its command runs it: a process of its own with JAX's
    defaults (one CPU device, XLA's thread pool sized to the cores), not this session's eight
    simulated devices and their oversized pool (that run took half as long again)."""
    png = tmp_path / "digits.png"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC")}
    proc = subprocess.run(
        [sys.executable, "examples/train_digits.py", "--png", str(png), "--no-progress"],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = _accuracy_table(proc.stdout)
    assert [(p, n) for p, (_, n) in table.items()] == [("fp32", 3), ("bf16", 3), ("fp16", 3)]
    acc = {p: mean for p, (mean, _) in table.items()}
    assert acc["fp32"] > 97.0, acc
    assert abs(acc["bf16"] - acc["fp32"]) <= 0.5, acc
    assert abs(acc["fp16"] - acc["fp32"]) <= 0.5, acc
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_fp16_without_loss_scaling_loses_accuracy(digits):
    acc = {}
    for precision in underflow_demo.PRECISIONS:
        config = train_digits.DigitsConfig(
            precision=precision, loss_multiplier=underflow_demo.DEFAULT_MULTIPLIER, steps=150
        )
        acc[precision] = train_digits.train(config, seed=0, data=digits).metric
    assert acc["fp32"] > 95.0, acc
    assert abs(acc["fp16"] - acc["fp32"]) <= 1.0, acc
    assert acc["fp16-noscale"] < acc["fp32"] - 20.0, acc

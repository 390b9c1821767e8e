"""The convergence study's sections: char-LM bits/byte and digits accuracy per state mode."""

from __future__ import annotations

from benchmarks.tables_format import markdown_table

_STATE_NAMES = {
    "f32": "float32",
    "bf16": "bfloat16, stochastic",
    "bf16-nearest": "bfloat16, nearest",
    "int8": "8-bit (int8 blockwise), nearest",
    "int8-stochastic": "8-bit (int8 blockwise), stochastic",
}
_CHECKS = ("losses", "metric", "masters")
_MASTER_NAMES = {"auto": "float32", "remainder": "int16 remainder"}


def _f(value: float, digits: int) -> str:
    return f"{value:.{digits}f}"


def _signed(value: float, digits: int, unit: str) -> str:
    return "-" if value == 0 else f"{value:+.{digits}f}{unit}"


def _identity_note(check: dict) -> str:
    """What the float32-master and remainder runs had in common, seed by seed."""
    per_seed = check.get("per_seed", [check])
    same = [i for i, c in enumerate(per_seed) if all(c[k] for k in _CHECKS)]
    text = "The runs with a float32 master and with the remainder are "
    if len(same) == len(per_seed):
        return text + (
            "bit for bit identical (every step's loss, the metric and the final float32 "
            f"masters; {_seeds(same)})."
        )
    parts = [f"bit for bit identical for {_seeds(same)}"] if same else []
    for i, c in enumerate(per_seed):
        if i not in same:
            losses = "the same losses" if c["losses"] else "different losses"
            n = c.get("differing_master_elements", "some")
            parts.append(f"seed {i} gave {losses}, {n} master elements apart")
    lead = text if same else "The runs with a float32 master and with the remainder differ: "
    return lead + "; ".join(parts) + " (see below)."


def _seeds(seeds: list[int]) -> str:
    return f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {', '.join(map(str, seeds))}"


def char_lm_section(result: dict) -> str:
    """Validation bits/byte of the char-LM per mode, and the remainder's bit-identity check."""
    lm = result["char_lm"]
    rows = []
    for r in lm["rows"]:
        bpb = _f(r["val_bits_per_byte"], 4)
        if lm["seeds"] > 1:
            bpb += f" ± {_f(r['val_bits_per_byte_std'], 4)}"
        master = _MASTER_NAMES[r["master_weights"]] if r["param_dtype"] == "bf16" else "none"
        rows.append(
            [
                "bfloat16" if r["param_dtype"] == "bf16" else "float32",
                master,
                _STATE_NAMES[r["optimizer_state"]],
                _f(r["bytes_per_param"], 2),
                bpb,
                _signed(r["vs_float32_state_pct"], 2, " %"),
            ]
        )
    seeds = "seed 0" if lm["seeds"] == 1 else f"mean ± std over seeds 0-{lm['seeds'] - 1}"
    columns = ["params", "master", "AdamW state", "bytes / param", f"val bits/byte ({seeds})"]
    columns.append("vs float32 state")
    note = f"{lm['steps']} steps. " + _identity_note(lm["bit_identical"])
    return markdown_table(columns, rows) + "\n\n" + note + "\n"


def digits_section(result: dict) -> str:
    """Test accuracy of the digits ResNet per AdamW state dtype."""
    d = result["digits"]
    rows = [
        [
            _STATE_NAMES[r["optimizer_state"]],
            _f(r["bytes_per_param"], 2),
            f"{r['accuracy_mean']:.2f} ± {r['accuracy_std']:.2f}",
            _signed(r["vs_float32_state_pp"], 2, " pp"),
        ]
        for r in d["rows"]
    ]
    columns = ["AdamW state", "bytes / param", f"test accuracy % (mean ± std, {d['seeds']} seeds)"]
    columns.append("vs float32 state")
    note = (
        f"{d['steps']} steps, seeds 0-{d['seeds'] - 1} for every mode (the same initialisations "
        f"and batch orders), {d['test_images']} test images "
        f"(one image is {100 / d['test_images']:.2f} pp)."
    )
    return markdown_table(columns, rows) + "\n\n" + note + "\n"

"""Convergence of the block-scaled recipes: the char-LM example under each, against bf16.

`examples/train_char_lm.py` (its default 500 steps, seed 0) trained with bf16 compute and
its GEMMs under `Fp8Recipe("mxfp8" | "blockwise" | "nvfp4")` (the example's
`FP8_RECIPES`: the byte head in bf16; NVFP4 with its default `high_precision_last`, which
keeps the last 2 of the 12 other GEMMs, the last block's MLP, in bf16), emulated on this CPU
(the same numbers as the native GEMMs: block scales are exact factors), and tensorwise fp8
for comparison; validation bits per byte against bf16. `--quick`: the tiny model of the
memory study, 20 steps.

    python benchmarks/run.py --only blocks-convergence
"""

from __future__ import annotations

__all__ = ["run"]

RECIPES = ("bf16", "fp8", "mxfp8", "blockwise", "nvfp4")


def run(quick: bool = False, seed: int = 0) -> dict:
    """Validation bits/byte of the char-LM under each recipe, and its change against bf16."""
    from benchmarks.memory_convergence import QUICK_CHAR_LM
    from examples.train_char_lm import CharLMConfig, load_corpus, make_train_fns, train

    corpus = load_corpus(200_000 if quick else 2_000_000)
    sizes = QUICK_CHAR_LM if quick else {}
    results = {}
    for precision in RECIPES:
        config = CharLMConfig(precision=precision, **sizes)
        results[precision] = train(config, seed, corpus=corpus, fns=make_train_fns(config))
        print(f"[blocks] char-LM {precision}: {results[precision].metric:.4f} bits/byte")
    ref = results["bf16"].metric
    rows = [
        [name, round(r.metric, 4), round(100 * (r.metric / ref - 1), 2), round(r.wall_s, 1)]
        for name, r in results.items()
    ]
    steps = CharLMConfig(precision="bf16", **sizes).steps
    return {
        "title": f"Char-LM validation bits/byte by recipe ({steps} steps, seed {seed})",
        "columns": ["recipe", "val bits/byte", "vs bf16 %", "wall s (CPU, emulated)"],
        "rows": rows,
        "notes": (
            "fp8: tensorwise current scaling. Block-scaled recipes emulated on the CPU (their "
            "numbers, not their speed); the byte head stays bf16 in every recipe, and nvfp4 "
            "keeps its default high_precision_last (the last 15 % of the GEMMs: the last "
            "block's MLP) in bf16."
        ),
    }

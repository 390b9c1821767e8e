"""Export a converted inference model with `jax.export`, to bytes and back; and its CLI.

CLI::

    python -m mpjax.export my_pkg.models:load_trained --input-shape 1,8,8,1 \\
        --policy compute=bfloat16 --platforms cpu,cuda --out model.mpjax
"""

from mpjax._src.inference.export import (
    LoadedInference,
    export_inference,
    load_inference,
    main,
    serialize_inference,
)

__all__ = ["LoadedInference", "export_inference", "load_inference", "serialize_inference"]

if __name__ == "__main__":
    raise SystemExit(main())

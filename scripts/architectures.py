#!/usr/bin/env python
"""Which mlx-lm (and mlx-vlm-only) architectures macinfer runs, and why the others are refused.

Builds every `model_type` mlx-lm implements (its model files and its remapped
aliases), and every one of mlx-vlm's that mlx-lm lacks (`architectures_mlx_vlm.json`),
as a tiny random model from `tests/zoo.py` and loads it the way
`macinfer` does (`macinfer.models.build_model`: mlx-lm's class, then the probe
that maps each cache to a cache spec). Writes the verdicts to
`macinfer/models/architectures.json`, which `macinfer models` and the CLI help
read; `tests/test_architectures.py` checks the file is current and that every
architecture listed as running matches mlx-lm token for token.

    python scripts/architectures.py          # rewrite the table
    python scripts/architectures.py --check  # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def verdict(model_type: str, load: bool = True) -> str:
    """"runs", or why `model_type` is refused: at build (the probe), or with `load`, by
    the engine's load-time comparison with mlx-lm's own forward on random weights."""
    import tempfile

    from macinfer.engine.llm_engine import EngineConfig, LLMEngine
    from macinfer.models import UnsupportedArchitectureError, build_model
    from tests.helpers import make_mlx_lm_model, save_model_dir
    from tests.zoo import tiny_config

    config = tiny_config(model_type)
    try:
        build_model(config, "mlx-lm")
        if load:
            with tempfile.TemporaryDirectory() as tmp:
                path = save_model_dir(tmp, config, make_mlx_lm_model(config, seed=7))
                LLMEngine(path, EngineConfig(kv_cache_gb=0.01, model_impl="mlx-lm"))
        return "runs"
    except UnsupportedArchitectureError as e:
        return str(e).removeprefix(f"unsupported architecture {model_type!r}: ")


def verdicts(load: bool = True) -> dict[str, str]:
    from macinfer.models.mlx_lm_classes import mlx_lm_model_types

    return {model_type: verdict(model_type, load) for model_type in mlx_lm_model_types()}


def vlm_verdicts(load: bool = True) -> dict[str, str]:
    """The same over mlx-vlm's model types that mlx-lm lacks (`macinfer/models/mlx_vlm_text.py`)."""
    from macinfer.models.mlx_lm_classes import mlx_lm_model_types
    from macinfer.models.mlx_vlm_text import mlx_vlm_only_model_types

    return {model_type: verdict(model_type, load) for model_type in mlx_vlm_only_model_types(mlx_lm_model_types())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the stored tables; exit 1 if one differs")
    args = ap.parse_args()
    from macinfer.models import VERDICTS_FILE, VLM_VERDICTS_FILE

    for path, table in ((VERDICTS_FILE, verdicts()), (VLM_VERDICTS_FILE, vlm_verdicts())):
        if args.check:
            with open(path) as f:
                if json.load(f) != table:
                    print(f"{path} is stale; run python scripts/architectures.py", file=sys.stderr)
                    sys.exit(1)
            continue
        with open(path, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
            f.write("\n")
        runs = sum(v == "runs" for v in table.values())
        print(f"{runs} of {len(table)} model types run; table written to {path}")


if __name__ == "__main__":
    main()

"""Build the standalone-MTP fixture: a Qwen3.5 target's MTP layers split into their own repository by mlx-vlm's code.

    pip install "mlx[cpu]"     # mlx-vlm's splitter runs on MLX; its Linux CPU wheel is enough
    python scripts/make_mtp_standalone_fixtures.py --mlx-vlm-repo DIR --out tests/fixtures/mtp_standalone

DIR is a checkout of Blaizzy/mlx-vlm (imported from there, nothing downloaded, none of its code copied here; CI never
runs this script, the tests read what it writes). What runs, unchanged: mlx_vlm/speculative/drafters/qwen3_5_mtp/
split.py `Qwen3_5MTPSplitter` through mlx_vlm/speculative/drafters/mtp_split.py `MTPSplitter.split`, which selects
the `mtp.*` tensors, runs `Qwen3_5MTPDraftModel.sanitize` (qwen3_5_mtp.py: strips `mtp.`, stores every 1-D float norm
(its norm_suffixes) as 1 + w, MLX's RMSNorm convention), saves model.safetensors with metadata {"format": "mlx"} and
writes config.json {"model_type": "qwen3_5_mtp", "text_config": the source's, "block_size", "tie_word_embeddings"}.

Its source is tests/fixtures/mtp/qwen3_5 (a tiny Qwen3.5 hybrid target with one MTP layer, fp32, whose numbers
test_mtp.py checks against vLLM's qwen3_5_mtp.py), given the nested config a published Qwen3.5 checkpoint has
(`text_config`; the splitter requires it). The test then loads the split repository as that target's MTP layers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "mtp" / "qwen3_5"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mlx-vlm-repo", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(args.mlx_vlm_repo))
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.split import Qwen3_5MTPSplitter

    text = json.loads((SOURCE / "config.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "Qwen3.5-tiny"
        src.mkdir()
        (src / "model.safetensors").symlink_to(SOURCE / "model.safetensors")
        (src / "config.json").write_text(json.dumps({
            "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
            "tie_word_embeddings": text.get("tie_word_embeddings", False)}))
        out = Qwen3_5MTPSplitter().split(str(src), str(args.out / "qwen3_5"))
    commit = subprocess.run(["git", "-C", str(args.mlx_vlm_repo), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    (out / "meta.json").write_text(json.dumps({
        "producer": "Blaizzy/mlx-vlm", "commit": commit, "source": "tests/fixtures/mtp/qwen3_5",
        "ran": "mlx_vlm/speculative/drafters/qwen3_5_mtp/split.py Qwen3_5MTPSplitter().split"}, indent=2) + "\n")
    print(f"wrote {sorted(p.name for p in out.iterdir())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

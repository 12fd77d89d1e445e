"""Rerun some rows of bench/results/attention_fidelity.{json,md} (`sgl-kvq eval attention`) after a format's code
changed, leaving the other rows as they were measured.

Each row's metrics depend only on its own format and the fp16 reference on the same captured Q/K/V
(bench/eval/attention.py: evaluate_layer), so evaluating a subset with the JSON's own settings gives the numbers
the full command would; the markdown table is regenerated from the merged JSON (attention.markdown).

    python scripts/rerun_attention_rows.py logquant-2 logquant-2-w21
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from bench.commands.eval_attention import _text, parse_layers
from bench.eval import attention
from sgl_kvq.formats.logquant import LogQuantParams

ROOT = Path(__file__).resolve().parents[1]
JSON = ROOT / "bench/results/attention_fidelity.json"
MD = ROOT / "bench/results/attention_fidelity.md"


def main(names: list[str]) -> int:
    t0 = time.time()
    result = json.loads(JSON.read_text())
    st = result["settings"]
    model, tok, _ = attention.load_model("smollm2")
    ids = tok(_text(None, result["tokens"]), return_tensors="pt").input_ids[:, :result["tokens"]]
    layers = parse_layers(None, model.config.num_hidden_layers)
    assert layers == result["layers"]
    torch.manual_seed(st["seed"])
    captured = attention.capture(model, ids, layers)
    del model
    table = attention.methods(st["group_size"], st["value_group"], st["residual"], None, st["seed"])
    sub = {n: table[n] for n in [attention.REFERENCE, *names]}
    rows = attention.evaluate(captured, sub, tail=st["tail"], log=print)["methods"]
    fp16_same = rows[attention.REFERENCE]["attn_err"] == result["methods"][attention.REFERENCE]["attn_err"]
    print(f"fp16 row reproduced: {fp16_same}")
    for n in names:
        result["methods"][n] = rows[n]
    st["window"] = LogQuantParams.window
    result["rerun"] = {"rows": names, "command": "python scripts/rerun_attention_rows.py " + " ".join(names),
                       "seconds": round(time.time() - t0, 1)}
    JSON.write_text(json.dumps(result, indent=1) + "\n")
    md = MD.read_text().split("\n")
    start = next(i for i, line in enumerate(md) if line.startswith("| method |"))
    end = next(i for i in range(start, len(md)) if not md[i].startswith("|"))
    MD.write_text("\n".join(md[:start] + attention.markdown(result).split("\n") + md[end:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

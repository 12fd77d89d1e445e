"""`sgl-kvq eval attention`: attention fidelity of every KV format on real Q/K/V (bench.eval.attention).

Standalone: python -m bench.commands.eval_attention [--tokens N] [--layers 0,5,10-12] [--methods fp16,kivi3,...]
[--json [PATH]] ...
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

from sgl_kvq import env
from sgl_kvq.config import KVQConfig
from sgl_kvq.formats.logquant import LogQuantParams

_DEFAULTS = {f.name: f.default for f in KVQConfig.__dataclass_fields__.values()}


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 | gemma3 | tiny | a model folder (default smollm2)")
    p.add_argument("--text", type=Path, help="text file to run on (default: the Paul Graham essays)")
    p.add_argument("--tokens", type=int, default=1536, help="sequence length T (default 1536)")
    p.add_argument("--layers", help="layer subset, e.g. 0,5,10-12 (default: all)")
    p.add_argument("--methods", help="comma-separated subset of the methods (default: all); fp16, the reference, "
                   "is always run")
    p.add_argument("--group-size", type=int, default=_DEFAULTS["group_size"], help="G: page / key group")
    p.add_argument("--value-group", type=int, default=_DEFAULTS["value_group"], help="VG: value channel group")
    p.add_argument("--residual", type=int, default=_DEFAULTS["residual"], help="R: fp16 window, multiple of G")
    p.add_argument("--window", type=int, help="LogQuant W of the logquant-2 row (default: the served logquant2's, "
                   "KVQ_LOGQUANT_WINDOW's default); logquant-2-w21 uses 21")
    p.add_argument("--tail", type=int, default=64, help="last queries used for the tail metrics (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", nargs="?", const="-", help="write the JSON result to PATH (stdout without PATH)")
    p.add_argument("--markdown", type=Path, help="write the markdown table (with the command) to PATH")


def parse_layers(spec: str | None, n: int) -> list[int]:
    if not spec:
        return list(range(n))
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    bad = [i for i in out if not 0 <= i < n]
    if bad:
        raise SystemExit(f"sgl-kvq eval attention: layers {bad} out of range 0..{n - 1}")
    return out


def select_methods(table: dict, spec: str | None, reference: str) -> dict:
    """The methods named in `spec` (comma-separated, table order kept), always with the reference first."""
    if not spec:
        return table
    wanted = {name.strip() for name in spec.split(",") if name.strip()}
    unknown = sorted(wanted - set(table))
    if unknown:
        raise SystemExit(f"sgl-kvq eval attention: unknown methods {unknown}; known: {', '.join(table)}")
    return {name: fn for name, fn in table.items() if name == reference or name in wanted}


def command(args) -> str:
    """The command line that ran: the standalone module's (args._argv), else `sgl-kvq eval attention`'s."""
    argv = getattr(args, "_argv", None)
    if argv is not None:
        return "python -m bench.commands.eval_attention " + shlex.join(argv)
    from bench.eval.engine_eval import argv_after

    return "sgl-kvq eval attention " + shlex.join(argv_after("attention"))


def _text(path: Path | None, tokens: int) -> str:
    if path is not None:
        return path.read_text(encoding="utf-8", errors="replace")
    from bench.data import essay_text

    return essay_text(min_chars=8 * tokens)


def run(args) -> int:
    import torch

    from bench.eval import attention

    t0 = time.time()
    log = (lambda msg: print(msg, file=sys.stderr)) if args.json == "-" else print
    model, tok, path = attention.load_model(args.model)
    ids = tok(_text(args.text, args.tokens), return_tensors="pt").input_ids[:, :args.tokens]
    if ids.shape[1] < args.tokens:
        log(f"note: the text has only {ids.shape[1]} tokens")
    layers = parse_layers(args.layers, model.config.num_hidden_layers)
    model_layers = model.config.num_hidden_layers
    table = select_methods(attention.methods(args.group_size, args.value_group, args.residual, args.window),
                           args.methods, attention.REFERENCE)
    torch.manual_seed(args.seed)
    captured = attention.capture(model, ids, layers)
    del model
    result = attention.evaluate(captured, table, tail=args.tail, log=log)
    first = captured[layers[0]]
    result.update({
        "command": command(args),
        "model": path, "tokens": int(ids.shape[1]), "layers": layers, "model_layers": model_layers,
        "shape": {"q_heads": first.q.shape[1], "kv_heads": first.k.shape[1], "head_dim": first.k.shape[2]},
        "settings": {"group_size": args.group_size, "value_group": args.value_group, "residual": args.residual,
                     "window": LogQuantParams.window if args.window is None else args.window, "tail": args.tail,
                     "seed": args.seed},
        "seconds": round(time.time() - t0, 1),
        **env.run_record(),
    })
    check = result["capture_check"]["max_rel_err"]
    table_md = attention.markdown(result)
    log(table_md)
    log(f"capture check (captured q/k/v reproduce the model's attention output): max rel err {check:.2e}")
    if args.json:
        text = json.dumps(result, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    if args.markdown:
        args.markdown.write_text(f"Command: `{result['command']}`\n\n{table_md}\n")
    return 0 if check < 1e-3 else 1


def main(argv: list[str] | None = None) -> int:
    from bench.commands._subcommands import standalone_main

    return standalone_main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())

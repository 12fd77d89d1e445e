"""`sgl-kvq calibrate`: each layer's key and value sensitivity to its code width, measured in the model on a
calibration text no evaluation reads, and the allocation of widths that meets --bits at the least measured KL
(bench/calibrate.py says how).

    sgl-kvq calibrate --model smollm2 --bits 3.0 --json bench/results/calibration/smollm2.json \
        --recipe-dir sgl_kvq/recipes

--recipe-dir writes each allocation as a recipe the kivimix dtype serves (sgl_kvq/recipe.py), named
<model>-<bits>.json. --from-json FILE allocates --bits from a result file's measured sensitivities without running
the model (the allocation's own KL is then predicted, the single-layer KLs summed, not measured):

    sgl-kvq calibrate --from-json bench/results/calibration/smollm2.json --bits 2.875 --recipe-dir sgl_kvq/recipes

An allocation from fewer widths than 1,2,3,4 is named for them, <model>-<bits>-w<widths>.json: --widths 2,3,4 keeps
every tensor at 2 bits or more, so a pooled fp16 frame spans 8 pages, not the 16 a 1-bit code row needs
(sgl_kvq/pool_shape.py pages_per_frame).

--splits K4V2,K2V4 adds fixed key/value widths, every layer alike, beside the calibrated allocations (measured with
the model; predicted from the single-layer KLs with --from-json), to ask whether a plain split is on the front:

    sgl-kvq calibrate --from-json bench/results/calibration/smollm2.json --splits K4V2,K2V4,K4V3,K3V2
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

from sgl_kvq.env import PREFILL_MODES

ALL_WIDTHS = (1, 2, 3, 4)


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 | gemma3 | tiny | a model folder (default smollm2)")
    p.add_argument("--bits", type=float, action="append",
                   help="mean code width of the allocation (repeat for several; default 3.0)")
    p.add_argument("--widths", default=",".join(map(str, ALL_WIDTHS)),
                   help="code widths a tensor may get (default 1,2,3,4)")
    p.add_argument("--tokens", type=int, default=1024, help="calibration tokens (default 1024)")
    p.add_argument("--group-size", type=int, default=64, help="G: page / key group (default 64)")
    p.add_argument("--residual", type=int, default=64, help="R: fp16 window, a multiple of G (default 64)")
    p.add_argument("--stride", type=int, default=1,
                   help="score every N-th position (default 1; Gemma 3's 262k-entry softmax makes 4 worth it)")
    p.add_argument("--json", type=Path, help="write the result to PATH")
    p.add_argument("--recipe-dir", type=Path, help="write each allocation as a recipe file (KVQ_RECIPE) into DIR")
    p.add_argument("--splits", default="",
                   help="fixed key/value widths to report beside the allocations, e.g. K4V2,K2V4")
    p.add_argument("--prefill", choices=PREFILL_MODES,
                   help="the KVQ_PREFILL the recipes made now are served with (default: leave it out, which serves "
                        "full); choose it by the rule of docs/knobs.md, KVQ_PREFILL")
    p.add_argument("--from-json", type=Path,
                   help="allocate from this result file's sensitivities instead of measuring (adds to its recipes)")


def recipes_from(result: dict, out_dir: Path) -> list[Path]:
    """Each allocation of a calibration result as a recipe file in out_dir, <model>-<bits>.json."""
    from sgl_kvq.recipe import ModelBinding, Recipe

    m = result["model"]
    binding = ModelBinding(m["layers"], m["kv_heads"], m["head_dim"], m["config_sha256"])
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, r in result["recipes"].items():
        made = {"command": r.get("command", result["command"]), "text": result["calibration"]["text"],
                "tokens": result["calibration"]["tokens"], "mean_bits": r["mean_bits"],
                "bytes_per_token": r["bytes_per_token"], "kl": r["kl"], "predicted_kl": r["predicted_kl"]}
        target, _, widths = key.partition("-")
        t = float(target)
        name = f"{t:.1f}" if round(t, 1) == t else f"{t:g}"
        path = out_dir / f"{m['name']}-{name}{'-' + widths if widths else ''}.json"
        recipe = Recipe(binding, tuple(r["k_bits"]), tuple(r["v_bits"]), prefill=r.get("prefill"))
        path.write_text(recipe.to_json(made))
        paths.append(path)
    return paths


def prefill_entry(args) -> dict:
    """A recipe entry's "prefill" (--prefill), which recipes_from writes into the recipe file."""
    return {"prefill": args.prefill} if args.prefill else {}


def parse_widths(text: str) -> list[int]:
    widths = sorted({int(w) for w in text.split(",") if w})
    if not widths or any(w not in ALL_WIDTHS for w in widths):
        raise SystemExit(f"sgl-kvq calibrate: --widths {text}: choose among 1,2,3,4")
    return widths


def parse_splits(text: str) -> dict[str, tuple[int, int]]:
    """"K4V2,K2V4" -> {"K4V2": (4, 2), ...}: every layer's keys at the first width, values at the second."""
    out = {}
    for name in filter(None, text.upper().split(",")):
        m = re.fullmatch(r"K([1-4])V([1-4])", name)
        if not m:
            raise SystemExit(f"sgl-kvq calibrate: --splits {text}: {name} is not K<bits>V<bits> with bits in 1-4 "
                             "(e.g. K4V2)")
        out[name] = (int(m[1]), int(m[2]))
    return out


def split_widths(split: tuple[int, int], layers: int) -> dict[tuple[int, str], int]:
    return {(layer, kind): b for layer in range(layers) for kind, b in zip(("k", "v"), split)}


def split_entries(sens: dict, splits: dict[str, tuple[int, int]], layers: int, bytes_of, kl_of=None) -> dict:
    """Each fixed split's mean width, bytes, summed single-layer KLs and (with kl_of) its measured KL."""
    out = {}
    for name, split in splits.items():
        w = split_widths(split, layers)
        missing = sorted({b for key, b in w.items() if b not in sens[key]})
        if missing:
            raise SystemExit(f"sgl-kvq calibrate: --splits {name}: no sensitivity measured at {missing} bits")
        out[name] = {"mean_bits": sum(w.values()) / len(w), "bytes_per_token": bytes_of(w),
                     "kl": kl_of(w) if kl_of else None, "predicted_kl": sum(sens[key][b] for key, b in w.items())}
    return out


def recipe_key(target: float, widths: list[int]) -> str:
    """A result's name for an allocation: its mean width, and the widths it drew from where not all of them."""
    return f"{target:g}" + ("" if tuple(widths) == ALL_WIDTHS else "-w" + "".join(map(str, widths)))


def allocation(sens: dict, target: float, layers: int) -> tuple[dict, dict]:
    """The widths at mean width `target` -> (widths, their entry in a result's recipes: per-layer widths and the
    summed single-layer KLs)."""
    from bench import calibrate as cal

    w = cal.allocate(sens, target)
    return w, {"k_bits": [w[(i, "k")] for i in range(layers)], "v_bits": [w[(i, "v")] for i in range(layers)],
               "predicted_kl": sum(sens[key][b] for key, b in w.items())}


def reallocate(args) -> int:
    """--from-json: new allocations from a result file's sensitivities, written into it and as recipes."""
    from bench import calibrate as cal

    result = json.loads(args.from_json.read_text())
    asked = parse_widths(args.widths)
    measured = {(int(key[1:]), key[0]): {int(b): kl for b, kl in s.items()}
                for key, s in result["sensitivity_kl"].items()}
    sens = {key: {b: kl for b, kl in s.items() if b in asked} for key, s in measured.items()}
    widths = sorted({b for s in sens.values() for b in s})  # those asked that the file measured
    if not widths:
        raise SystemExit(f"sgl-kvq calibrate: --widths {args.widths}: {args.from_json} measured none of them")
    m, c = result["model"], result["calibration"]
    reader = cal.Reader({}, group_size=c["group_size"], residual=c["residual"])

    def bytes_of(w):
        return cal.bytes_per_token(w, m["kv_heads"], m["head_dim"], reader)

    splits = parse_splits(args.splits)
    for target in args.bits or ([] if splits else [3.0]):
        w, entry = allocation(sens, target, m["layers"])
        result["recipes"][recipe_key(target, widths)] = {
            "command": "sgl-kvq calibrate " + " ".join(sys.argv[2:]), "mean_bits": sum(w.values()) / len(w),
            "bytes_per_token": bytes_of(w), "kl": None, **entry, **prefill_entry(args)}
    if splits:  # a split's widths need not be among --widths: every width the file measured
        result.setdefault("splits", {}).update(split_entries(measured, splits, m["layers"], bytes_of))
    args.from_json.write_text(json.dumps(result, indent=1) + "\n")
    if args.recipe_dir:
        for path in recipes_from(result, args.recipe_dir):
            print(f"recipe: {path}", file=sys.stderr)
    return 0


def run(args) -> int:
    if args.from_json:
        return reallocate(args)
    import torch

    from bench import calibrate as cal
    from bench.data import calibration_text
    from bench.eval.attention import load_model
    from sgl_kvq.recipe import config_sha256

    torch.manual_seed(0)
    widths = parse_widths(args.widths)
    splits = parse_splits(args.splits)
    unmeasured = sorted({b for split in splits.values() for b in split} - set(widths))
    if unmeasured:
        raise SystemExit(f"sgl-kvq calibrate: --splits {args.splits} needs widths {unmeasured}, not in --widths "
                         f"{args.widths}")
    targets = args.bits or [3.0]
    if args.residual % args.group_size:
        raise SystemExit(f"sgl-kvq calibrate: --residual {args.residual} must be a multiple of G={args.group_size}")
    model, tok, folder = load_model(args.model)
    text_cfg = getattr(model.config, "text_config", model.config)
    L, H = text_cfg.num_hidden_layers, text_cfg.num_key_value_heads
    D = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
    ids = tok(calibration_text(8 * args.tokens), return_tensors="pt", add_special_tokens=False).input_ids
    ids = ids[:, :args.tokens]
    if ids.shape[1] < cal.first_read_position(cal.Reader({}, args.group_size, 64, args.residual)) + args.group_size:
        raise SystemExit(f"sgl-kvq calibrate: --tokens {args.tokens} reads no packed page at G={args.group_size}, "
                         f"R={args.residual}")

    keep = cal.scored_positions(cal.Reader({}, args.group_size, 64, args.residual, args.stride), ids.shape[1])

    def reader(w):
        return cal.Reader(w, group_size=args.group_size, residual=args.residual, stride=args.stride)

    t0 = time.time()
    with torch.no_grad():
        native = model(input_ids=ids, logits_to_keep=keep).logits
    cached = cal.LayerOutputs(model, ids, keep)  # nothing quantized
    reference = cached.logits
    check = float((reference - native).abs().max())  # the simulated read, nothing quantized, is the model's own
    sens: dict[tuple[int, str], dict[int, float]] = {}
    for layer in range(L):
        for kind in cal.KINDS:
            sens[(layer, kind)] = {b: cal.model_kl(model, ids, reader({(layer, kind): b}), reference, cached)
                                   for b in widths}
        print(f"layer {layer}: " + "  ".join(f"{k}{b} {sens[(layer, k)][b]:.4f}" for k in cal.KINDS
                                              for b in widths) + f"  ({time.time() - t0:.0f}s)", file=sys.stderr)

    def measured(w):
        return {"mean_bits": sum(w.values()) / len(w), "bytes_per_token": cal.bytes_per_token(w, H, D, reader(w)),
                "kl": cal.model_kl(model, ids, reader(w), reference)}

    uniform = {f"kivi{b}": measured({key: b for key in sens}) for b in widths}
    recipes = {}
    for target in targets:
        w, entry = allocation(sens, target, L)
        recipes[recipe_key(target, widths)] = {**measured(w), **entry, **prefill_entry(args)}
    fixed = split_entries(sens, splits, L, lambda w: cal.bytes_per_token(w, H, D, reader(w)),
                          lambda w: cal.model_kl(model, ids, reader(w), reference))
    result = {
        "command": "sgl-kvq calibrate " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["calibrate"] else None,
        "model": {"name": args.model, "layers": L, "kv_heads": H, "head_dim": D,
                  "config_sha256": config_sha256(folder)},
        "calibration": {"text": "ShareGPT records from bench.data.CALIBRATION_FIRST_RECORD", "tokens": ids.shape[1],
                        "group_size": args.group_size, "residual": args.residual,
                        "read_check_max_abs_logit_diff": check, "seconds": round(time.time() - t0)},
        "sensitivity_kl": {f"{k}{layer}": {str(b): v for b, v in s.items()} for (layer, k), s in sens.items()},
        "uniform": uniform,
        "recipes": recipes,
        **({"splits": fixed} if fixed else {}),
    }
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    if args.recipe_dir:
        for path in recipes_from(result, args.recipe_dir):
            print(f"recipe: {path}", file=sys.stderr)
    for name, r in {**uniform, **{f"recipe {t}": r for t, r in recipes.items()}, **fixed}.items():
        print(f"{name:12s} {r['mean_bits']:.2f} bits  {r['bytes_per_token']:8.0f} B/token  KL {r['kl']:.4f}")
    return 0

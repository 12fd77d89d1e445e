"""A recipe: which code width each layer's keys and values get, bound to the model it was calibrated on
(`sgl-kvq calibrate --recipe-dir DIR` writes one per target; the kivimix dtype serves it: KVQ_RECIPE=PATH).

A recipe is a small JSON file:

    {"format": "sgl_kvq recipe 1",
     "model": {"layers": 30, "kv_heads": 3, "head_dim": 64, "config_sha256": "6f1339384eecc10d"},
     "key_bits": [1, 3, ...], "value_bits": [2, 2, ...],
     "prefill": "paged",
     "calibration": {...what made it: the command, its measured KL and bytes per token}}

"prefill" (optional) is the KVQ_PREFILL the recipe is served with unless that variable is set: the prefill rule of
docs/knobs.md (KVQ_PREFILL) picks differently for different recipes (docs/recipes.md, "Which prefill a recipe
takes"). Without it a recipe prefills "full".

The model block is what a server checks before loading (model_check.check_hf_config): the layer count, KV heads and
head_dim of the Hugging Face config, and the sha256 of the model folder's config.json (its first 16 hex digits) where
the folder is local. A recipe's digest (the sha256 of its widths and its model block) joins the pool's fingerprint,
so two servers with different recipes never read each other's pages.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from sgl_kvq.env import PREFILL_MODES
from sgl_kvq.errors import KVQConfigError

FORMAT_TAG = "sgl_kvq recipe 1"
WIDTHS = (1, 2, 3, 4)
# The recipes sgl-kvq ships, by name (KVQ_RECIPE=smollm2-3.0 is sgl_kvq/recipes/smollm2-3.0.json).
SHIPPED = Path(__file__).parent / "recipes"


@dataclass(frozen=True)
class ModelBinding:
    layers: int
    kv_heads: int
    head_dim: int
    config_sha256: str  # sha256 of the model folder's config.json, first 16 hex digits


@dataclass(frozen=True)
class Recipe:
    model: ModelBinding
    key_bits: tuple[int, ...]
    value_bits: tuple[int, ...]
    prefill: str | None = None  # the KVQ_PREFILL this recipe is served with by default; None: the dtype's (full)
    source: str = ""  # where it was read from (a path), for errors

    def __post_init__(self):
        n = self.model.layers
        if len(self.key_bits) != n or len(self.value_bits) != n:
            raise KVQConfigError(f"sgl_kvq: recipe {self.source}: {len(self.key_bits)} key and "
                                 f"{len(self.value_bits)} value widths for a model of {n} layers")
        bad = sorted({b for b in (*self.key_bits, *self.value_bits) if b not in WIDTHS})
        if bad:
            raise KVQConfigError(f"sgl_kvq: recipe {self.source}: widths {bad}; each must be one of {WIDTHS}")
        if self.prefill is not None and self.prefill not in PREFILL_MODES:
            raise KVQConfigError(f"sgl_kvq: recipe {self.source}: \"prefill\": {self.prefill!r}; choose one of "
                                 f"{', '.join(PREFILL_MODES)} or leave it out")

    def widths(self, layer: int) -> tuple[int, int]:
        """(key bits, value bits) of layer `layer`."""
        return self.key_bits[layer], self.value_bits[layer]

    @property
    def mean_bits(self) -> float:
        return (sum(self.key_bits) + sum(self.value_bits)) / (2 * self.model.layers)

    @property
    def digest(self) -> str:
        """What decides the stored bytes: the widths and the model they are for (not the file's other keys)."""
        body = json.dumps([self.model.__dict__, self.key_bits, self.value_bits], sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()[:12]

    def __str__(self) -> str:  # the fingerprint's part (KVQConfig.fingerprint): [A-Za-z0-9] only
        return self.digest

    def to_json(self, calibration: dict | None = None) -> str:
        """The file's text: one key per line, each list on its line (a layer's widths read down the columns)."""
        body = {"format": FORMAT_TAG, "model": self.model.__dict__, "key_bits": list(self.key_bits),
                "value_bits": list(self.value_bits), **({"prefill": self.prefill} if self.prefill else {}),
                "calibration": calibration or {}}
        return "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in body.items()) + "\n}\n"

    def check_model(self, layers: int, kv_heads: int, head_dim: int, config_sha256: str | None, arch: str) -> None:
        """Raise KVQConfigError unless the model is the one this recipe was made for (config_sha256 None: the
        model's config.json is not a local file; the geometry alone is checked)."""
        m = self.model
        got = {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim}
        want = {"layers": m.layers, "kv_heads": m.kv_heads, "head_dim": m.head_dim}
        if config_sha256 is not None:
            got["config_sha256"], want["config_sha256"] = config_sha256, m.config_sha256
        differ = [f"{k} {got[k]} (the recipe's {want[k]})" for k in want if got[k] != want[k]]
        if differ:
            raise KVQConfigError(f"sgl_kvq: recipe {self.source} was calibrated on another model than {arch}: "
                                 f"{', '.join(differ)}; make one for this model with `sgl-kvq calibrate --model "
                                 "MODEL --recipe-dir DIR` and set KVQ_RECIPE to it")


def config_sha256(folder: str | Path) -> str | None:
    """sha256 of a model folder's config.json (first 16 hex digits), None where there is no such local file."""
    path = Path(folder) / "config.json"
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else None


def shipped() -> list[str]:
    return sorted(p.stem for p in SHIPPED.glob("*.json"))


def load_recipe(spec: str) -> Recipe:
    """KVQ_RECIPE's value: a path to a recipe file, or the name of a shipped one."""
    path = Path(spec)
    if not path.is_file() and (SHIPPED / f"{spec}.json").is_file():
        path = SHIPPED / f"{spec}.json"
    if not path.is_file():
        raise KVQConfigError(f"sgl_kvq: KVQ_RECIPE={spec!r} is neither a file nor a shipped recipe; shipped: "
                             f"{', '.join(shipped()) or 'none'}")
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != FORMAT_TAG:
            raise KVQConfigError(f"sgl_kvq: {path} is not a recipe (its \"format\" is {raw.get('format')!r}, "
                                 f"a recipe's is {FORMAT_TAG!r})")
        model = ModelBinding(**{k: raw["model"][k] for k in ("layers", "kv_heads", "head_dim", "config_sha256")})
        return Recipe(model, tuple(int(b) for b in raw["key_bits"]), tuple(int(b) for b in raw["value_bits"]),
                      prefill=raw.get("prefill"), source=str(path))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, KVQConfigError):
            raise
        raise KVQConfigError(f"sgl_kvq: recipe {path} cannot be read ({type(e).__name__}: {e}); "
                             "`sgl-kvq calibrate --recipe-dir DIR` writes valid ones") from None

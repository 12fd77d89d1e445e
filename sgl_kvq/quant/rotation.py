"""Orthogonal rotations along head_dim, and a wrapper that runs any KV format in the rotated basis.

Vectors are rows: x_rot = x @ R with R [D, D] orthogonal (R @ R.T = I). Rotating q and k alike leaves every score
unchanged ((q R)(k R)^T = q k^T), and attention over rotated values is the rotated output (P (V R) = (P V) R), so
"rotate q/k/v, attend, rotate the output back with R.T" equals plain attention (tests/unit/test_quant_peers.py holds
this to 1e-5 in fp32). A format that quantizes in the rotated basis therefore changes attention only through its
quantization error, and the attention it gives equals plain attention over its reconstructions rotated back:
(q R)(K_hat_rot)^T = q (K_hat_rot R^T)^T and P V_hat_rot R^T = P (V_hat_rot R^T). `rotated` returns exactly those
reconstructions, so the offline eval (bench.eval.attention) scores a rotated format without a second attention
path.

The rotation is one fixed matrix per head_dim shared by every layer, head and token (a constant of the format, like
a codebook): it costs no cache bytes.

- hadamard(d): the Sylvester-Hadamard matrix divided by sqrt(d) (symmetric, orthogonal, d a power of two). Used by
  kivi2-had / kivi3-had; block_hadamard(d), its blocks along the diagonal for any d (what KVQ_ROTATE serves).
- random_orthogonal(d, seed): a Haar-random orthogonal matrix, QR of a seeded standard normal matrix with the signs
  of R's diagonal folded in; the same construction as vLLM's TurboQuant generate_rotation_matrix
  (vllm/model_executor/layers/quantization/turboquant/quantizer.py).
- rht_signs(d): the +-1 vector of vLLM's randomized Hadamard transform for int4_per_token_head
  (vllm/v1/attention/ops/int4_per_token_head.py, _get_rht_signs(d, 0)).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from sgl_kvq.quant.compressed import CompressedKV


@lru_cache(maxsize=16)
def _sylvester(d: int) -> torch.Tensor:
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Sylvester-Hadamard matrix needs a power-of-two size, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def sylvester_hadamard(d: int) -> torch.Tensor:
    """The unnormalized +-1 Hadamard matrix H_d (H_d @ H_d = d I), float32."""
    return _sylvester(d).float()


def hadamard(d: int) -> torch.Tensor:
    """H_d / sqrt(d): orthogonal and symmetric (its own inverse), float32."""
    return (_sylvester(d) / d ** 0.5).float()


def block_hadamard(d: int) -> torch.Tensor:
    """The normalized Hadamard matrix of the largest power of two b dividing d, repeated d / b times along the
    diagonal: orthogonal and symmetric for every d (H_d itself when d is a power of two; head_dim 192 gets three
    64-blocks, 48 three 16-blocks), float32."""
    b = d & -d
    return torch.block_diag(*[hadamard(b)] * (d // b)) if b != d else hadamard(d)


def random_orthogonal(d: int, seed: int = 42) -> torch.Tensor:
    """Haar-random orthogonal [d, d] float32 from `seed` (vLLM TurboQuant's generate_rotation_matrix)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    g = torch.randn(d, d, generator=gen, dtype=torch.float32)
    q, r = torch.linalg.qr(g)
    sign = torch.sign(torch.diag(r))
    sign[sign == 0] = 1.0
    return q * sign.unsqueeze(0)


def rht_signs(d: int, round_idx: int = 0) -> torch.Tensor:
    """vLLM's deterministic +-1 signs of the randomized Hadamard transform H (D x), float32 [d]."""
    gen = torch.Generator(device="cpu").manual_seed(0x9E3779B9 + round_idx * 0x517CC1B7)
    return 2.0 * torch.bernoulli(torch.full((d,), 0.5), generator=gen) - 1.0


def is_orthogonal(r: torch.Tensor, atol: float = 1e-5) -> bool:
    eye = torch.eye(r.shape[0], dtype=r.dtype)
    return bool(torch.allclose(r @ r.T, eye, atol=atol) and torch.allclose(r.T @ r, eye, atol=atol))


def rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """[..., D] @ R."""
    return x.float() @ r


def unrotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """[..., D] @ R.T, the inverse of rotate."""
    return x.float() @ r.T


def rotated(fn, basis, keys: bool = True):
    """A method fn(k, v, q, sm_scale) -> CompressedKV run in a rotated basis.

    `basis` maps head_dim -> R (e.g. hadamard). q, k and v are rotated alike, fn quantizes the rotated k and v, and
    the reconstructions come back rotated by R.T: attention over them with the original q is the rotated attention
    with its output rotated back (module docstring). With keys=False only v is rotated (q and k as they are: the
    scores need no rotation, and only the output is rotated back). Bytes (fn's `stored`) and the kept mask are fn's."""

    def method(k, v, q, s):
        r = basis(k.shape[-1])
        if not keys:
            c = fn(k.float(), rotate(v, r), q.float(), s)
            return CompressedKV(c.k_hat, unrotate(c.v_hat, r), c.stored, c.kept)
        c = fn(rotate(k, r), rotate(v, r), rotate(q, r), s)
        return CompressedKV(unrotate(c.k_hat, r), unrotate(c.v_hat, r), c.stored, c.kept)

    return method

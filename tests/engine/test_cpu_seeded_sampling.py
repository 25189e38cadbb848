"""Seeded sampling on hsnap's CPU platform: ``murmur_hash32_cpu`` is SGLang's murmur hash, bit for
bit, and the platform's ``--enable-deterministic-inference`` seams (hsnap_sglang/cpu/deterministic.py).

* a pure-Python MurmurHash3_x86_32 (written from the algorithm) reproduces the algorithm's published test vectors;
  the platform's op equals it on SGLang's 16-byte message (seed low, seed high, position, column) for seeds over
  all 64 bits, positions beyond 2**32 and negative, both position dtypes;
* the op equals SGLang's own Triton kernel (``murmur_hash32_kernel``, run by Triton's CPU interpreter) and SGLang's
  own CPU test values, through SGLang's ``murmur_hash32`` dispatch (``torch.ops.sgl_kernel.murmur_hash32_cpu``);
* the platform plug-in accepts torch_native as a deterministic attention backend and keeps SGLang's Triton
  batch-invariant overrides of ``aten::mm`` off CPU.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from hsnap_sglang.cpu import ops  # noqa: E402

M32 = 0xFFFFFFFF


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & M32


def murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    """MurmurHash3_x86_32 (Austin Appleby, SMHasher), in plain Python integers."""
    c1, c2 = 0xCC9E2D51, 0x1B873593
    h = seed & M32
    blocks = len(data) // 4
    for i in range(blocks):
        k = int.from_bytes(data[4 * i : 4 * i + 4], "little")
        k = (_rotl((k * c1) & M32, 15) * c2) & M32
        h = (_rotl(h ^ k, 13) * 5 + 0xE6546B64) & M32
    tail = data[4 * blocks :]
    if tail:
        k = int.from_bytes(tail, "little")
        h ^= (_rotl((k * c1) & M32, 15) * c2) & M32
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


# (data, seed, hash): MurmurHash3_x86_32's published verification values (SMHasher's algorithm; the table
# widely reproduced with it)
PUBLISHED = [
    (b"", 0, 0x00000000),
    (b"", 1, 0x514E28B7),
    (b"", 0xFFFFFFFF, 0x81F16F39),
    (b"\xff\xff\xff\xff", 0, 0x76293B50),
    (b"\x21\x43\x65\x87", 0, 0xF55B516B),
    (b"\x21\x43\x65\x87", 0x5082EDEE, 0x2362F9DE),
    (b"\x21\x43\x65", 0, 0x7E4A8634),
    (b"\x21\x43", 0, 0xA0F7B07A),
    (b"\x21", 0, 0x72661CF4),
    (b"\x00\x00\x00\x00", 0, 0x2362F9DE),
    (b"\x00\x00\x00", 0, 0x85F0B427),
    (b"\x00\x00", 0, 0x30F4C306),
    (b"\x00", 0, 0x514E28B7),
    (b"aaaa", 0x9747B28C, 0x5A97808A),
    (b"Hello, world!", 0x9747B28C, 0x24884CBA),
    (b"The quick brown fox jumps over the lazy dog", 0x9747B28C, 0x2FA826CD),
]

# SGLang's own CPU test of murmur_hash32 (test/srt/cpu/test_murmur_hash.py upstream): seeds, positions, columns, hashes
SGLANG_SEEDS = [0, 1, 42, 0x123456789ABCDEF0]
SGLANG_POSITIONS = [0, 7, 123, 456]
SGLANG_COLUMNS = [0, 1, 2, 17]
SGLANG_EXPECTED = [
    [2167721464, 10027521, 2423355346, 2203067026],
    [3755322398, 4196701286, 1002451629, 183234019],
    [772287619, 548237471, 2740678348, 3656549299],
    [3746406971, 2891010872, 104055988, 3372550890],
]


def _message(seed: int, position: int, column: int) -> bytes:
    """The 16 bytes SGLang's kernel hashes: seed low and high 32 bits, position and column low 32 bits."""
    parts = (seed & M32, (seed >> 32) & M32, position & M32, column & M32)
    return b"".join(p.to_bytes(4, "little") for p in parts)


@pytest.mark.parametrize("data,seed,expected", PUBLISHED)
def test_reference_murmur3_reproduces_published_vectors(data, seed, expected):
    assert murmur3_x86_32(data, seed) == expected


@pytest.mark.parametrize("positions_dtype", [torch.int64, torch.uint64])
def test_murmur_hash32_cpu_equals_murmur3_on_sglangs_message(positions_dtype):
    r = random.Random(5)
    seeds = [0, 1, M32, M32 + 1, 2**63 - 1, 2**63, 2**64 - 1] + [r.getrandbits(64) for _ in range(9)]
    positions = [r.randrange(0, 2**33) for _ in seeds]  # beyond 2**32: the kernel keeps the low 32 bits
    if positions_dtype == torch.int64:
        positions[:3] = [-1, -(2**40) - 3, 2**63 - 1]
    cols = [0, 1, 2, 17, 511, 1023, 1024, 1025, 151935] + [r.randrange(2**31) for _ in range(7)]
    pos_t = torch.tensor([p if p < 2**63 else p - 2**64 for p in positions], dtype=torch.int64)
    if positions_dtype == torch.uint64:
        pos_t = pos_t.view(torch.uint64)
    seed_t = torch.tensor([s - 2**64 if s >= 2**63 else s for s in seeds], dtype=torch.int64).view(torch.uint64)
    out = ops.murmur_hash32(seed_t, pos_t, torch.tensor(cols))
    assert out.dtype == torch.uint32 and tuple(out.shape) == (len(seeds), len(cols))
    expected = [[murmur3_x86_32(_message(s, p, c)) for c in cols] for s, p in zip(seeds, positions)]
    assert out.to(torch.int64).tolist() == expected
    # each row alone hashes as it does in the batch (a request's draws do not depend on its batch)
    assert torch.equal(ops.murmur_hash32(seed_t[3:4], pos_t[3:4], torch.tensor(cols)), out[3:4])


def test_murmur_hash32_cpu_refuses_what_sgl_kernel_refuses():
    seed, pos, cols = torch.zeros(2, dtype=torch.uint64), torch.zeros(2, dtype=torch.int64), torch.arange(3)
    for args, what in (((seed.to(torch.int64), pos, cols), "seed must have dtype torch.uint64"),
                       ((seed, pos.to(torch.int32), cols), "positions must have dtype"),
                       ((seed, pos[:1], cols), "same length"),
                       ((seed, pos, cols.to(torch.int32)), "col_indices must have dtype torch.int64")):
        with pytest.raises(RuntimeError, match=what):
            ops.murmur_hash32(*args)


_SGLANG_KERNEL = """
import json, os, random
import torch
from hsnap_sglang.cpu import activate
activate()
from sglang.kernels.ops.sampling.murmur_hash import murmur_hash32, murmur_hash32_kernel

def triton_kernel(seed, positions, cols):  # SGLang's Triton kernel itself, on Triton's CPU interpreter
    out = torch.empty((seed.shape[0], cols.shape[0]), dtype=torch.uint32)
    murmur_hash32_kernel[(seed.shape[0], -(-cols.shape[0] // 1024))](seed, positions, cols, out, seed.shape[0],
                                                                      cols.shape[0], BLOCK_SIZE=1024)
    return out

r = random.Random(11)
seed = torch.tensor([r.getrandbits(63) for _ in range(5)] + [-1, -(2**62)], dtype=torch.int64).view(torch.uint64)
positions = torch.tensor([r.randrange(2**34) for _ in range(6)] + [-5], dtype=torch.int64)
cols = torch.arange(2500)  # three of the kernel's 1024-column blocks
kernel = triton_kernel(seed, positions, cols)
ours = murmur_hash32(seed, positions, cols)  # SGLang's dispatch for CPU tensors: torch.ops.sgl_kernel.murmur_hash32_cpu
published = murmur_hash32(torch.tensor(%(seeds)r, dtype=torch.uint64), torch.tensor(%(positions)r),
                          torch.tensor(%(cols)r))
print(json.dumps({"equal": torch.equal(kernel, ours), "dtype": str(ours.dtype), "interpreted": os.environ["TRITON_INTERPRET"],
                  "published": published.to(torch.int64).tolist()}))
"""


def test_murmur_hash32_cpu_is_bit_exact_with_sglangs_triton_kernel():
    env = dict(os.environ, HSNAP_SGLANG_CPU="1", TRITON_INTERPRET="1")
    code = _SGLANG_KERNEL % {"seeds": SGLANG_SEEDS, "positions": SGLANG_POSITIONS, "cols": SGLANG_COLUMNS}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"equal": True, "dtype": "torch.uint32", "interpreted": "1", "published": SGLANG_EXPECTED}


_DETERMINISTIC_SEAMS = """
import json, torch
from hsnap_sglang.cpu import sglang_plugin
from sglang.srt.arg_groups.choices import DETERMINISTIC_ATTENTION_BACKEND_CHOICES, RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND
before = list(DETERMINISTIC_ATTENTION_BACKEND_CHOICES)
sglang_plugin()
sglang_plugin()  # idempotent
from sglang.srt.plugins.hook_registry import HookRegistry
HookRegistry.apply_hooks()
from sglang.srt.batch_invariant_ops import enable_batch_invariant_mode, is_batch_invariant_mode_enabled
enable_batch_invariant_mode()  # what ModelRunner.maybe_enable_batch_invariant_mode calls under the flag
a, b = torch.randn(3, 8), torch.randn(8, 5)
print(json.dumps({"before": "torch_native" in before, "after": DETERMINISTIC_ATTENTION_BACKEND_CHOICES.count("torch_native"),
                  "radix": "torch_native" in RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND,
                  "mode": is_batch_invariant_mode_enabled(), "mm": torch.equal(torch.mm(a, b), a @ b)}))
"""


def test_platform_lets_deterministic_inference_run_with_torch_native_and_no_triton():
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    env["HSNAP_SGLANG_CPU"] = "1"
    out = subprocess.run([sys.executable, "-c", _DETERMINISTIC_SEAMS], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # torch_native accepted once; not for the radix cache (a cache hit changes prefill rounding); no Triton overrides
    assert result == {"before": False, "after": 1, "radix": False, "mode": False, "mm": True}

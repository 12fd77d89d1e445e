"""What a running SGLang process's resident memory holds: its live Python objects by type, its live torch tensors'
bytes, and what glibc hands back to the OS on malloc_trim(0). Read by attaching gdb to the process, which runs a few
lines of Python in it under the GIL and calls malloc_trim. Why: the 30-minute soaks' resident memory grows in the
scheduler process alone (docs/soak.md), and its size cannot say whether live objects grow (a leak) or freed memory
stays mapped (the allocator's caches and fragmentation).

    python bench/scheduler_heap.py PID [--trim] [--json out.json]

The process stops while gdb holds it (a second or two); run it between requests, or accept a stalled step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

PROBE = r'''
import collections, gc, json
_objs = gc.get_objects()
_types = collections.Counter(type(o).__name__ for o in _objs)
_tensors, _seen, _bytes = 0, set(), 0
try:
    import torch
    for _o in _objs:
        if isinstance(_o, torch.Tensor) and _o.device.type == "cpu":
            _tensors += 1
            _s = _o.untyped_storage()
            if _s.data_ptr() not in _seen:
                _seen.add(_s.data_ptr())
                _bytes += _s.nbytes()
except Exception as _e:
    _tensors = repr(_e)
json.dump({"objects": len(_objs), "top_types": _types.most_common(30), "cpu_tensors": _tensors,
           "cpu_tensor_storage_bytes": _bytes}, open(PROBE_OUT, "w"))
del _objs, _types, _seen
'''


def rss(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


def gdb(pid: int, calls: list[str]) -> str:
    cmd = ["gdb", "-p", str(pid), "-batch", "-nx"]
    for c in calls:
        cmd += ["-ex", c]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return r.stdout + r.stderr


def probe(pid: int, trim: bool) -> dict:
    """-> the process's Python objects and tensors, and its RSS before and after malloc_trim(0) (when trim)."""
    with tempfile.TemporaryDirectory() as tmp:
        out, script = os.path.join(tmp, "probe.json"), os.path.join(tmp, "probe.py")
        with open(script, "w") as f:
            f.write(f"PROBE_OUT = {out!r}\n" + PROBE)
        os.chmod(tmp, 0o777)
        before = rss(pid)
        log = gdb(pid, ["call (int)PyGILState_Ensure()",
                        f'call (int)PyRun_SimpleString("exec(open(\'{script}\').read())")',
                        "call (void)PyGILState_Release($1)"])
        if not os.path.exists(out):
            raise RuntimeError(f"the probe did not run in {pid}:\n{log[-2000:]}")
        result = json.load(open(out))
    result["rss_mib"] = round(before / 2**20, 1)
    if trim:
        gdb(pid, ["call (int)malloc_trim(0)"])
        time.sleep(0.5)
        result["rss_after_malloc_trim_mib"] = round(rss(pid) / 2**20, 1)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pid", type=int)
    p.add_argument("--trim", action="store_true", help="then call malloc_trim(0) and read RSS again")
    p.add_argument("--json", metavar="PATH", help="append the result to this JSON list")
    args = p.parse_args(argv)
    result = {"pid": args.pid, "at": time.strftime("%Y-%m-%dT%H:%M:%S"), **probe(args.pid, args.trim)}
    print(json.dumps({k: v for k, v in result.items() if k != "top_types"}), file=sys.stderr)
    if args.json:
        old = json.load(open(args.json)) if os.path.exists(args.json) else []
        json.dump(old + [result], open(args.json, "w"), indent=1)
    else:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

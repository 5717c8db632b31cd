"""Which instruction-set settings change the tiny run's bits, and what the pin costs in time on this machine.

    PYTHONPATH=. python benchmarks/cpu_isa.py                 # every setting once, then the timing rounds (~15 min)
    PYTHONPATH=. python benchmarks/cpu_isa.py --rounds 0      # the bits only
    PYTHONPATH=. python benchmarks/cpu_isa.py --settings "" --rounds 3   # the timing only
    PYTHONPATH=. python benchmarks/cpu_isa.py --ops           # which kernels each variable changes (seconds)

Each run is the main job made short: ``laconic-nemo train recipes/tiny_cpu.yaml warmup.num_steps=100
run.num_steps=3`` (2 ranks, its own warm-up: no cache is shared between settings), into ``--out``/<setting>. A
setting is the environment of the launch (:data:`SETTINGS`): the machine's own choices (``LACONIC_CPU_ISA=native``),
each library's variable alone, and the pin (``LACONIC_CPU_ISA=avx2``; the default is ``native``), also over
variables that stand for another machine's own choice. The first table gives, per setting, the warm-up's NLL at step 100 and
the first rollout's mean length (printed in full), lambda after step 3, and sha256 digests of the cached warm-up
policy's tensors and of the metrics rows without their timings; settings with the same digests share a letter.

The timing rounds alternate the machine's own choices and the pin (``--rounds`` pairs, in one window, so that the
load of a shared machine falls on both alike) and print the warm-up's seconds per step, the GRPO step's seconds
(mean of steps 2-3: step 1 includes the start of the reward workers), the whole run's wall-clock and CPU seconds
(user + system of the launcher, its ranks and their workers: less sensitive than the wall clock to what else
the machine runs) and the ratio of the pin to the native setting.

``--ops`` runs the model's kernels alone (one process per setting, float32, one thread): a matmul, a batched
matmul, softmax and log-softmax, layer norm, GELU, exp, sqrt, the scaled-dot-product attention and one Adam step
(torch.optim.Adam, as megatron's optimiser runs on CPU) on fixed random inputs, and prints, per setting, the branch
MKL reports (``mkl_serv_cbwr_get``: 1 off, 2 AUTO, 3 COMPATIBLE), a digest of each result (a letter per distinct
result, per kernel) and how many of 36,864 float32 square roots differ from the correctly rounded ones (float64
sqrt rounded to float32): a kernel that is not correctly rounded computes with approximate instructions, whose
bits are the processor's (docs/megatron_cpu.md, "Which kernels part two machines").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIB_VARS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "LACONIC_CPU_ISA")
# name -> (what it is, the launch's environment)
SETTINGS = {
    "native": ("this machine's own choices (LACONIC_CPU_ISA=native)", {"LACONIC_CPU_ISA": "native"}),
    "aten_avx2": ("ATEN_CPU_CAPABILITY=avx2", {"LACONIC_CPU_ISA": "native", "ATEN_CPU_CAPABILITY": "avx2"}),
    "aten_default": ("ATEN_CPU_CAPABILITY=default", {"LACONIC_CPU_ISA": "native", "ATEN_CPU_CAPABILITY": "default"}),
    "mkl_compatible": ("MKL_CBWR=COMPATIBLE", {"LACONIC_CPU_ISA": "native", "MKL_CBWR": "COMPATIBLE"}),
    "mkl_avx2": ("MKL_CBWR=AVX2", {"LACONIC_CPU_ISA": "native", "MKL_CBWR": "AVX2"}),
    "onednn_avx2": ("ONEDNN_MAX_CPU_ISA=AVX2", {"LACONIC_CPU_ISA": "native", "ONEDNN_MAX_CPU_ISA": "AVX2"}),
    "pin": ("the pin (LACONIC_CPU_ISA=avx2)", {"LACONIC_CPU_ISA": "avx2"}),
    "pin_over_other": ("the pin, over ATEN_CPU_CAPABILITY=default MKL_CBWR=AUTO ONEDNN_MAX_CPU_ISA=SSE41",
                       {"LACONIC_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "AUTO",
                        "ONEDNN_MAX_CPU_ISA": "SSE41"}),
}
SHORT = ["warmup.num_steps=100", "run.num_steps=3", "logging.plot=false", "logging.tensorboard=false"]


def say(msg: str) -> None:
    print(f"[cpu-isa] {msg}", flush=True)


def run(name: str, env_extra: dict, out: Path) -> dict:
    """One short run under ``env_extra`` (the library variables of this environment dropped first)."""
    import torch

    d = out / name
    if d.exists():
        shutil.rmtree(d)
    env = {k: v for k, v in os.environ.items() if k not in LIB_VARS}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **env_extra)
    cmd = [sys.executable, "-m", "laconic_nemo", "train", "recipes/tiny_cpu.yaml", *SHORT, f"run.output_dir={d}",
           f"warmup.cache_dir={d / 'cache'}"]
    t0, ru0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall, ru1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)  # the launcher, its ranks and workers
    if proc.returncode != 0:
        raise SystemExit(f"[cpu-isa] {name} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
    bare = [{k: v for k, v in r.items() if not k.startswith(("time/", "step_seconds"))} for r in rows]
    (cache,) = (d / "cache").glob("policy_*")
    h = hashlib.sha256()
    for shard in sorted(cache.glob("*.pt")):
        for k, v in sorted(torch.load(shard, weights_only=False).items()):
            if isinstance(v, torch.Tensor):
                h.update(k.encode() + v.contiguous().numpy().tobytes())
    nll = re.findall(r"warmup\s+100/100 \| nll/token ([0-9.]+) \| ([0-9.]+)s", proc.stdout)
    return {"name": name, "wall": wall, "cpu_s": cpu_s, "warmup_nll": float(nll[-1][0]), "warmup_s": float(nll[-1][1]),
            "first_length": rows[0]["mean_response_length"], "lambda_3": rows[-1]["lambda_next"],
            "policy": h.hexdigest()[:12], "metrics": hashlib.sha256(json.dumps(bare, sort_keys=True).encode())
            .hexdigest()[:12], "step_s": [r["step_seconds"] for r in rows],
            "isa": json.loads((cache / "meta.json").read_text())["key"]["cpu_isa"]}


def bits_table(results: list[dict]) -> str:
    letters: dict[tuple, str] = {}
    lines = ["| setting | warm-up NLL at step 100 | first rollout, mean length | lambda after step 3 | warm-up "
             "policy | metrics | bits |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        key = (r["policy"], r["metrics"])
        letters.setdefault(key, "ABCDEFGHIJ"[len(letters)])
        lines.append(f"| {SETTINGS[r['name']][0]} | {r['warmup_nll']:.4f} | {r['first_length']!r} | "
                     f"{r['lambda_3']:.6f} | {r['policy']} | {r['metrics']} | {letters[key]} |")
    return "\n".join(lines)


def timing_table(pairs: list[tuple[dict, dict]]) -> str:
    def per(rs, f):
        vals = [f(r) for r in rs]
        return sum(vals) / len(vals)

    native, pin = [a for a, _ in pairs], [b for _, b in pairs]
    rows = [("warm-up, seconds per step", lambda r: r["warmup_s"] / 100),
            ("GRPO step, seconds (steps 2-3)", lambda r: sum(r["step_s"][1:]) / len(r["step_s"][1:])),
            ("whole short run, seconds", lambda r: r["wall"]),
            ("whole short run, CPU seconds (all its processes)", lambda r: r["cpu_s"])]
    lines = [f"| {len(pairs)} alternating pairs | native | pin | pin / native |", "| --- | --- | --- | --- |"]
    for label, f in rows:
        a, b = per(native, f), per(pin, f)
        lines.append(f"| {label} | {a:.3f} | {b:.3f} | {b / a:.2f} |")
    return "\n".join(lines)


OPS_CODE = r"""
import ctypes, hashlib, json, os, torch
torch.manual_seed(0)
torch.set_num_threads(1)
lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
f = getattr(lib, "mkl_serv_cbwr_get", None)
a, w, x3 = torch.randn(256, 96), torch.randn(384, 96), torch.randn(8, 64, 24)
F = torch.nn.functional
ops = {"matmul": lambda: a @ w.t(), "bmm": lambda: torch.bmm(x3, x3.transpose(1, 2)),
       "softmax": lambda: torch.softmax(a, -1), "log_softmax": lambda: torch.log_softmax(a, -1),
       "layer_norm": lambda: F.layer_norm(a, (96,)), "gelu": lambda: F.gelu(a), "exp": lambda: torch.exp(a),
       "sqrt": lambda: torch.sqrt(a.abs()),
       "sdpa": lambda: F.scaled_dot_product_attention(x3[None], x3[None], x3[None], is_causal=True)}


def adam():
    p = torch.nn.Parameter(torch.randn(192, 192, generator=torch.Generator().manual_seed(1)))
    p.grad = torch.randn(192, 192, generator=torch.Generator().manual_seed(2))
    torch.optim.Adam([p], lr=1e-3).step()
    return p.detach()


ops["adam step"] = adam
out = {k: hashlib.sha256(g().contiguous().numpy().tobytes()).hexdigest()[:8] for k, g in ops.items()}
r = torch.rand(192 * 192, generator=torch.Generator().manual_seed(3))
wrong = int((r.sqrt() != r.double().sqrt().float()).sum())
print(json.dumps({"aten": torch.backends.cpu.get_cpu_capability(), "mkl_branch": f(1) if f else None, **out,
                  "sqrt_wrong": wrong}))
"""
OPS_SETTINGS = {  # name -> the process's environment (library variables of this environment dropped first)
    "none": {}, "ATEN_CPU_CAPABILITY=avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "ATEN_CPU_CAPABILITY=default": {"ATEN_CPU_CAPABILITY": "default"},
    "MKL_CBWR=AUTO": {"MKL_CBWR": "AUTO"}, "MKL_CBWR=AVX2": {"MKL_CBWR": "AVX2"},
    "MKL_CBWR=AVX512": {"MKL_CBWR": "AVX512"}, "MKL_CBWR=COMPATIBLE": {"MKL_CBWR": "COMPATIBLE"},
    "MKL_ENABLE_INSTRUCTIONS=AVX2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "ONEDNN_MAX_CPU_ISA=AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "the pin": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}


def ops_rows(settings: dict[str, dict], prefix: list[str]) -> list[dict]:
    """One process per setting (``prefix``: e.g. ``qemu-x86_64 -cpu EPYC-Rome-v2``, another processor emulated);
    its kernels' digests, ATen's capability, MKL's branch and the square roots that are not correctly rounded."""
    rows = []
    for name, extra in settings.items():
        env = {k: v for k, v in os.environ.items() if k not in (*LIB_VARS, "MKL_ENABLE_INSTRUCTIONS")}
        out = subprocess.run([*prefix, sys.executable, "-c", OPS_CODE], env={**env, **extra}, capture_output=True,
                             text=True, check=True).stdout
        rows.append({"setting": name, **json.loads(out.splitlines()[-1])})
    return rows


def ops_table(by_processor: dict[str, list[dict]]) -> str:
    """Per processor and setting, a letter per distinct result of each kernel (shared by all rows: two rows with
    one letter computed the same bits)."""
    first = next(iter(by_processor.values()))[0]
    kernels = [k for k in first if k not in ("setting", "aten", "mkl_branch", "sqrt_wrong")]
    letters = {k: {} for k in kernels}
    many = len(by_processor) > 1
    lines = ["| " + ("processor | " if many else "") + "setting | ATen in effect | MKL branch | " + " | ".join(kernels)
             + " | sqrt not correctly rounded |",
             "| " + ("--- | " if many else "") + "--- | --- | --- | " + " | ".join("---" for _ in kernels) + " | --- |"]
    for proc, rows in by_processor.items():
        for r in rows:
            cells = [letters[k].setdefault(r[k], "ABCDEFGHIJKLMNOP"[len(letters[k])]) for k in kernels]
            lines.append("| " + (f"{proc} | " if many else "") + f"{r['setting']} | {r['aten']} | {r['mkl_branch']} | "
                         + " | ".join(cells) + f" | {r['sqrt_wrong']:,} of {192 * 192:,} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    ap.add_argument("--rounds", type=int, default=2, help="alternating native / pin pairs for the timing")
    ap.add_argument("--out", default="results/cpu_isa")
    ap.add_argument("--ops", action="store_true", help="only the kernels alone, per setting")
    ap.add_argument("--emulate", default="", help="with --ops: comma-separated CPU models of qemu-x86_64 (e.g. "
                    "EPYC-Rome-v2,Skylake-Client-v4: an AMD and an Intel CPUID, AVX2) to run the machine's own and the "
                    "pinned kernels on besides this processor (Debian's qemu-user; slow: a minute or two per model)")
    args = ap.parse_args(argv)
    if args.ops:
        by_processor = {"this machine": ops_rows(OPS_SETTINGS, [])}
        for model in filter(None, args.emulate.split(",")):
            if shutil.which("qemu-x86_64") is None:
                ap.error("--emulate needs qemu-x86_64 (apt-get install qemu-user)")
            by_processor[f"qemu {model}"] = ops_rows({k: OPS_SETTINGS[k] for k in ("none", "the pin")},
                                                     ["qemu-x86_64", "-cpu", model])
        print(ops_table(by_processor))
        return 0
    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    bad = [s for s in names if s not in SETTINGS]
    if bad or args.rounds < 0:
        ap.error(f"--settings: unknown {bad} (allowed {', '.join(SETTINGS)}); --rounds >= 0")
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    say(f"CPU: {cpu}; {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}")
    results = []
    for name in names:
        say(f"{name}: {SETTINGS[name][0]}")
        results.append(run(name, SETTINGS[name][1], out))
        (out / "results.json").write_text(json.dumps({"cpu": cpu, "bits": results}, indent=1))
        say(f"  -> warm-up NLL {results[-1]['warmup_nll']}, first length {results[-1]['first_length']}, "
            f"digests {results[-1]['policy']} {results[-1]['metrics']}, {results[-1]['wall']:.0f} s")
    if results:
        print(bits_table(results))
    pairs = []
    for i in range(args.rounds):
        say(f"timing round {i + 1}/{args.rounds} (load average {os.getloadavg()[0]:.1f})")
        pairs.append((run("native", SETTINGS["native"][1], out / "timing"), run("pin", {}, out / "timing")))
        (out / "results.json").write_text(json.dumps({"cpu": cpu, "bits": results, "timing": pairs}, indent=1))
    if pairs:
        say(f"load average at the end {os.getloadavg()[0]:.1f}")
        print(timing_table(pairs))
    (out / "results.json").write_text(json.dumps({"cpu": cpu, "bits": results, "timing": pairs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

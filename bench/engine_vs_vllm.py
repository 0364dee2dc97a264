"""Generated tokens/s of the built-in engine against vLLM (CPU) and transformers, one run.

The workload of issue 12: SmolLM2-135M-Instruct, random ``--prompt-len`` token prompts,
exactly ``--output-len`` greedy tokens each, all requests submitted at once, timed from
submission to the last token (prefill included), at each concurrency and dtype. vLLM runs in
its own virtualenv (``--vllm-python``, default ~/.cache/omniflow/venvs/vllm) as a subprocess
driving ``LLM.generate`` with the same token ids; the engine and transformers run here.

    python bench/engine_vs_vllm.py                             # 1, 8, 32 x bf16, fp32
    python bench/engine_vs_vllm.py --concurrency 1,8 --dtypes bfloat16 --repeat 2
    python bench/engine_vs_vllm.py --busy 1                    # a second process spins a core
    python bench/engine_vs_vllm.py --baseline cdd3cb8          # also the engine as of a commit

With fewer ``--threads`` than cores, every system is bound to the same first cores (vLLM
through ``VLLM_CPU_OMP_THREADS_BIND``, the others by CPU affinity), and ``--busy N`` spins N
processes on those same cores, one each: every system shares its cores with them alike.
Every system runs in a fresh process of its own on the same prompts; ``--baseline REF``
adds the engine package as it was at git ``REF`` (exported into a temporary folder that
shadows the installed one): before/after in the same run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

DEFAULT_MODEL = Path.home() / ".cache/omniflow/models/smollm2-135m-instruct"
DEFAULT_VLLM = Path.home() / ".cache/omniflow/venvs/vllm/bin/python"

# Runs inside the vLLM virtualenv: argv[1] is a JSON job; prints one JSON line of results.
VLLM_SCRIPT = r"""
import json, sys, time
job = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"],
          enable_prefix_caching=False, max_num_seqs=max(job["levels"]), seed=0,
          max_num_batched_tokens=job["budget"])
def go(prompts, n):
    sp = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    dt = time.perf_counter() - t
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    assert got == n * len(prompts), got
    return got / dt, [list(o.outputs[0].token_ids) for o in outs]
go(job["prompts"]["1"][:1], 4)
res = {}
for lvl in job["levels"]:
    best, toks = 0.0, None
    for _ in range(job["repeat"]):
        rate, toks = go(job["prompts"][str(lvl)], job["output_len"])
        best = max(best, rate)
    res[str(lvl)] = {"tok_s": best, "first": toks[0]}
print("RESULT " + json.dumps(res), flush=True)
"""


# Runs one system (our engine, or transformers) on every level: argv[1] is a JSON job;
# prints one JSON line. Every system runs in a fresh process of its own, like vLLM.
SYSTEM_SCRIPT = r"""
import json, sys, time, torch
job = json.loads(sys.argv[1])
if job["cores"]:  # the cores vLLM's threads are bound to
    import os
    os.sched_setaffinity(0, job["cores"])
torch.set_num_threads(job["threads"])
lv, n_out = job["levels"], job["output_len"]
prompts = job["prompts"]
if job["system"] == "engine":
    from omniflow_services.worker.engine import Engine, EngineConfig, GenerateRequest
    from omniflow_services.worker.engine import SamplingParams
    import omniflow_services.worker.engine as mod
    assert mod.__file__.startswith(job["root"]), (mod.__file__, job["root"])
    per_req = -(-(job["prompt_len"] + n_out) // 16)
    cfg = EngineConfig(dtype=job["dtype"], num_pages=per_req * max(lv) + 8,
                       max_num_batched_tokens=job["budget"], max_num_seqs=max(64, max(lv)),
                       enable_prefix_cache=False)
    e = Engine(job["model"], cfg)
    def go(ps, n):
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        first = []
        t = time.perf_counter()
        for i, p in enumerate(ps):
            e.add_request(GenerateRequest(f"r{i}", tuple(p), params=sp))
        got = 0
        while e.has_unfinished():
            for o in e.step():
                got += len(o.new_token_ids)
                if o.request_id == "r0":
                    first.extend(o.new_token_ids)
        assert got == n * len(ps)
        return got / (time.perf_counter() - t), first
else:
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        job["model"], dtype=getattr(torch, job["dtype"])).eval()
    hf.generation_config.eos_token_id = None
    def go(ps, n):
        ids = torch.tensor(ps)
        with torch.inference_mode():
            t = time.perf_counter()
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=0)
            dt = time.perf_counter() - t
        return (out.shape[1] - ids.shape[1]) * ids.shape[0] / dt, out[0, ids.shape[1]:].tolist()
go([prompts[str(lv[0])][0][:32]], 2)
res = {}
for n in lv:
    best, first = 0.0, []
    for _ in range(job["repeat"]):
        rate, first = go(prompts[str(n)], n_out)
        best = max(best, rate)
    res[str(n)] = {"tok_s": best, "first": first}
print("RESULT " + json.dumps(res), flush=True)
"""


def _result(proc: subprocess.CompletedProcess[str], what: str) -> dict[str, dict]:
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    sys.stderr.write(proc.stderr[-4000:])
    raise RuntimeError(f"{what} run failed (exit {proc.returncode}); its stderr is above")


def run_system(
    args: argparse.Namespace,
    dtype: str,
    prompts: dict[int, list[list[int]]],
    system: str,
    ref: str = "",
) -> dict[str, dict]:
    """``system`` ("engine" or "hf") in a fresh subprocess; the engine as of git ``ref``
    when given (exported into a temporary folder that shadows the installed package)."""
    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="omniflow-bench-") as tmp:
        root = Path(tmp)
        env = dict(os.environ)
        pkg = repo / "services"
        if ref:
            tree = subprocess.run(
                ["git", "-C", str(repo), "archive", ref, "services/worker/engine"],
                capture_output=True,
                check=True,
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(root)], input=tree, check=True)
            # services/ is the omniflow_services package; shadow only the engine subpackage.
            pkg = root / "omniflow_services"
            (pkg / "worker").mkdir(parents=True)
            (root / "services/worker/engine").rename(pkg / "worker/engine")
            for init in (pkg / "__init__.py", pkg / "worker/__init__.py"):
                init.write_text("")
            env["PYTHONPATH"] = str(root)
        job = {
            "system": system,
            "model": str(args.model),
            "dtype": dtype,
            "levels": list(prompts),
            "prompts": {str(k): v for k, v in prompts.items()},
            "output_len": args.output_len,
            "prompt_len": args.prompt_len,
            "repeat": args.repeat,
            "budget": args.token_budget,
            "threads": args.threads,
            "cores": bound_cores(args.threads),
            "root": str(pkg),
        }
        proc = subprocess.run(
            [sys.executable, "-c", SYSTEM_SCRIPT, json.dumps(job)],
            env=env,
            capture_output=True,
            text=True,
            timeout=args.vllm_timeout,
        )
    return _result(proc, f"{system} {ref}".strip())


def prompts_for(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1000 + n)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def run_vllm(
    args: argparse.Namespace, dtype: str, prompts: dict[int, list[list[int]]]
) -> dict[str, dict]:
    job = {
        "model": str(args.model),
        "dtype": dtype,
        "levels": list(prompts),
        "prompts": {str(k): v for k, v in prompts.items()},
        "output_len": args.output_len,
        "repeat": args.repeat,
        "max_model_len": args.prompt_len + args.output_len + 16,
        "budget": args.token_budget,
    }
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # vLLM binds one OpenMP thread per listed core: the cores our engine is bound to.
    cores = bound_cores(args.threads)
    bind = ",".join(map(str, cores)) if cores else "auto"
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # A session of its own: on a timeout, vLLM's engine processes go with it (killing only
    # the process we started would leave them running, orphaned).
    proc = subprocess.Popen(
        [str(args.vllm_python), "-c", VLLM_SCRIPT, json.dumps(job)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=args.vllm_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(
            f"vLLM did not finish within --vllm-timeout {args.vllm_timeout} s"
        ) from None
    return _result(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), "vLLM")


def bound_cores(threads: int) -> list[int]:
    """The cores every system runs on with ``threads`` threads: the first ``threads`` of
    this process's cores, or [] (unbound, vLLM's "auto") when it uses them all."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[:threads] if threads < len(cores) else []


def _spin(core: int) -> None:
    """Busy on ``core``: one of the cores the measured systems run on."""
    os.sched_setaffinity(0, {core})
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="an HF folder")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--token-budget", type=int, default=2048, help="tokens per step (both)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    ap.add_argument("--repeat", type=int, default=1, help="runs per level; the best is kept")
    ap.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM)
    ap.add_argument("--vllm-timeout", type=float, default=900.0)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--busy", type=int, default=0, help="processes spinning a core meanwhile")
    ap.add_argument("--baseline", default="", help="also run the engine as of this git ref")
    args = ap.parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(f"no model at {args.model}: run `omniflow models pull smollm2-135m-instruct`")
        return 2
    torch.set_num_threads(args.threads)
    levels = [int(x) for x in args.concurrency.split(",") if x]
    dtypes = [d for d in args.dtypes.split(",") if d]
    # The spinners sit on the measured cores (the first ones), one core each.
    targets = bound_cores(args.threads) or sorted(os.sched_getaffinity(0))
    spinners = [
        multiprocessing.Process(target=_spin, args=(targets[i % len(targets)],), daemon=True)
        for i in range(args.busy)
    ]
    for s in spinners:
        s.start()
    load0 = os.getloadavg()
    rows = []
    try:
        for dtype in dtypes:
            rows += bench_dtype(args, dtype, levels)
    finally:
        for s in spinners:
            s.kill()
    load1 = os.getloadavg()
    print(
        f"\n{args.model.name}: prompt {args.prompt_len}, output {args.output_len}, greedy, "
        f"{args.threads} torch threads, busy processes {args.busy}, "
        f"load average before {load0[0]:.2f} after {load1[0]:.2f}"
    )
    base = f" | {'baseline':>8} | {'base/vLLM':>9}" if args.baseline else ""
    head = (
        f"{'dtype':>8} | {'concurrent':>10} | {'vLLM tok/s':>10} | {'Omni-Flow':>10} | "
        f"{'transformers':>12} | {'Omni/vLLM':>9} | {'same tokens':>11}{base}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        v = f"{r['vllm']:10.1f}" if r["vllm"] else f"{'-':>10}"
        h = f"{r['hf']:12.1f}" if r["hf"] else f"{'-':>12}"
        ratio = f"{r['ours'] / r['vllm']:8.2f}x" if r["vllm"] else f"{'-':>9}"
        # the first request's greedy tokens: how many leading ones equal vLLM's
        same = "-" if r["same"] is None else f"{r['same']}/{r['out']}"
        extra = ""
        if args.baseline:
            b = r["base"]
            br = f"{b / r['vllm']:8.2f}x" if r["vllm"] else f"{'-':>9}"
            extra = f" | {b:8.1f} | {br}"
        print(
            f"{r['dtype']:>8} | {r['n']:>10} | {v} | {r['ours']:10.1f} | {h} | {ratio} | "
            f"{same:>11}{extra}"
        )
    if args.baseline:
        print(f"baseline: the engine as of {args.baseline}")
    return 0


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def bench_dtype(args: argparse.Namespace, dtype: str, levels: list[int]) -> list[dict]:
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    prompts = {n: prompts_for(n, args.prompt_len, vocab) for n in levels}
    vllm = {} if args.skip_vllm else run_vllm(args, dtype, prompts)
    base = run_system(args, dtype, prompts, "engine", args.baseline) if args.baseline else {}
    ours = run_system(args, dtype, prompts, "engine")
    hf = {} if args.skip_hf else run_system(args, dtype, prompts, "hf")
    rows = []
    for n in levels:
        k = str(n)
        v = vllm.get(k)
        rows.append(
            {
                "dtype": dtype,
                "n": n,
                "ours": ours[k]["tok_s"],
                "hf": hf[k]["tok_s"] if hf else 0.0,
                "vllm": v["tok_s"] if v else 0.0,
                "same": common_prefix(v["first"], ours[k]["first"]) if v else None,
                "out": len(ours[k]["first"]),
                "base": base[k]["tok_s"] if base else 0.0,
            }
        )
        r = rows[-1]
        print(
            f"{dtype} {n}: ours {r['ours']:.1f} hf {r['hf']:.1f} vllm {r['vllm']:.1f}", flush=True
        )
    return rows


if __name__ == "__main__":
    raise SystemExit(main())

"""Bare vLLM's c=16 throughput with ours idle beside it vs ours paused (SIGSTOP), taking turns."""
import json, os, signal, subprocess, sys, time
from pathlib import Path
import psutil
sys.path.insert(0, "/work/main")
from serve_app.bench.vllm import bare_vllm

root = psutil.Process(int(open("/tmp/run.pid").read()))
ours = [root, *root.children(recursive=True)]
print("ours:", len(ours), "processes")

def signal_all(sig):
    for p in ours:
        try:
            os.kill(p.pid, sig)
        except ProcessLookupError:
            pass

results = []
with bare_vllm(Path("/work/main/configs/local-bench.yaml")) as (url, model):
    order = ["running", "paused", "paused", "running", "running", "paused"]
    for i, cond in enumerate(order):
        out = Path(f"/tmp/exp/pause/{i}-{cond}")
        if cond == "paused":
            signal_all(signal.SIGSTOP)
        time.sleep(3)
        try:
            subprocess.run(["/work/main/.venv/bin/serve-app", "bench", "--target", url, "--api-key", "none",
                            "--model", model, "--concurrency", "16", "--rounds", "2", "--ignore-eos", "--no-cpu",
                            "--region", "bare", "--out-dir", str(out)], check=True,
                           stdout=open(f"{out}.log", "w"), stderr=subprocess.STDOUT)
        finally:
            if cond == "paused":
                signal_all(signal.SIGCONT)
        js = next(out.rglob("llm_bench.json"))
        d = json.load(open(js))
        r = d["results"]["16"]["ours"]
        results.append((cond, r.get("summary", {}).get("sustained_tok_s") if isinstance(r, dict) else None))
        print(i, cond, js)

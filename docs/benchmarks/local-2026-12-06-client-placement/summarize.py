"""Per run: sustained tok/s (median of rounds) and CPU-s per 1,000 tokens under steady load."""
import gzip, json, sys, glob, statistics as st
print("| run | client | ours tok/s | bare tok/s | ratio (median of 4 rounds) | ours TTFT p50 | bare TTFT p50 | engine worker ours / bare | engine core ours / bare | CPU ratio, steady |")
print("|---|---|---|---|---|---|---|---|---|---|")
for path in sys.argv[1:]:
    d = json.load(gzip.open(glob.glob(path + '/llm_bench.json.gz')[0]))
    R = d['results']['16']
    med = {s: st.median(x['sustained']['tokens_per_s'] for x in R[s]['rounds']) for s in ('ours', 'baseline')}
    g = {s: R['cpu'][s]['steady']['groups'] for s in ('ours', 'baseline')}
    name = path.rstrip('/').split('/')[-1]
    print(f"| {name[-6:]} | {'pinned to CPU 1' if '-P-' in name else 'free'} | {med['ours']:,.0f} | {med['baseline']:,.0f} | "
          f"{R['spread']['tokens_per_s_ratio']['median']:.3f}× | {R['ours']['summary']['ttft_ms_p50']:.0f} ms | "
          f"{R['baseline']['summary']['ttft_ms_p50']:.0f} ms | {g['ours']['engine worker']:.3f} / {g['baseline']['engine worker']:.3f} | "
          f"{g['ours']['EngineCore']:.3f} / {g['baseline']['EngineCore']:.3f} | {R['spread']['steady_cpu_ratio']['median']:.2f}× |")

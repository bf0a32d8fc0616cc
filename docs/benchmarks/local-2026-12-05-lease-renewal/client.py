import time, httpx, statistics, sys, json
key=open('/tmp/key').read().strip()
c=httpx.Client(base_url='http://127.0.0.1:8000', headers={'Authorization':'Bearer '+key}, timeout=60)
N=int(sys.argv[1]); ttft=[]
for n in range(N):
    t=time.perf_counter(); first=None
    with c.stream('POST','/v1/chat/completions', json={'model':'qwen-3.6-35b-a3b','messages':[{'role':'user','content':f'count {n}'}],'max_tokens':64,'stream':True,'ignore_eos':True}) as r:
        for line in r.iter_lines():
            if first is None and '"content"' in line and '"content":""' not in line: first=(time.perf_counter()-t)*1000
    ttft.append(first)
t=sorted(ttft[3:]); print('n',len(t),'p50 %.2f p25 %.2f p75 %.2f p95 %.2f'%(statistics.median(t),t[len(t)//4],t[3*len(t)//4],t[int(len(t)*.95)]))

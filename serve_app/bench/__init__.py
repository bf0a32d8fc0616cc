"""Benchmarks after the model card's published method: ``serve-app bench`` (streams) and
``serve-app bench-capacity`` (router requests/s), ours against a baseline on the same machine;
``serve-app idle`` (``serve_app.bench.idle``), the running service's CPU with no traffic.

Streams (``serve_app.bench.streams``). Streaming chat completions per side and per concurrency
(``--concurrency 1,16,32``), the card's prompt, ``max_tokens``
(``--max-tokens``), optionally ``ignore_eos`` so a random-weight model always writes max_tokens.
Each request carries a fresh W3C ``traceparent``; its trace id is kept with the run. Per stream,
on the client's clock (``time.perf_counter``):

- **TTFT (end to end)**: request start → first SSE chunk with a non-empty ``delta.content``
  (or ``delta.reasoning_content`` / ``delta.reasoning``, or completions ``text``);
- **server-only TTFT**: from the server's ``pg_metadata`` event, ``queue_ms + inference_ttft_ms``
  — waiting (whatever ``queue_ms`` covers: the engine's scheduler queue, and Serve's queue for
  a replica slot where the router reports it), then prefill up to the first token. It leaves
  out the router's own work (auth, body, prompt rendering, SSE transport), which
  ``pg_metadata`` counts in ``network_ms``; bare vLLM sends no ``pg_metadata``, so its
  server-only figures are None;
- **network overhead**: TTFT (end to end) − server-only TTFT, per request; the table gives the
  p50 (and p95) of those differences, not the difference of two percentiles;
- **throughput per stream**: decode tokens/s = (completion tokens − 1) / (last token − first
  token), TTFT excluded; completion tokens from the final usage chunk (``stream_options.
  include_usage``), or the number of token chunks if the server sends no usage;
- **aggregate tokens/s**: a side's completion tokens / the summed wall time of its counted batches;
- **sustained tokens/s**: the tokens that arrive between the moment the last worker of a batch
  gets its first token and the moment the first worker ends its last request, over that time
  (``serve_app.bench.stats.sustained``: ramp-up and tail left out).

Percentiles are nearest rank (sorted values, index ceil(q/100 · n) − 1): always a measured value.
Errors (non-200, a broken stream, no token) are counted by reason and never stop the run.

Fairness on a small machine (2 cores here, shared by client, router, proxy and engine):

- ``--baseline-vllm CONFIG`` starts bare vLLM's OpenAI server with exactly the engine flags the
  config gives ``--model``'s replica inside Serve, under ``nice -n 15`` because Ray runs its workers (our
  engine) at nice 15, and stops it afterwards. ``--baseline URL`` uses a server already running.
- The same workload runs against both sides **interleaved**, never both busy at once, and each
  side **alone**: the other side's processes are stopped (SIGSTOP) during its batches and the
  quiet around them (``serve_app.bench.alone``; ``--no-alone``). Per
  concurrency, one uncounted warm-up batch per side (``--warmup`` requests per worker), then
  ``--rounds`` rounds (default 5) of one batch per side, the order flipping each round (A,B
  then B,A…) to cancel order effects. In a batch every worker sends ``--requests-per-worker``
  (default 5) requests back to back (or ``--batch-s`` seconds of them; ``--round-size`` /
  ``--runs`` set the sizes directly, as before).
- Before every batch, ``--quiet-s`` of sleep, then the **measured quiet**: the host's CPU (less
  the client's) sampled until it is at most the idle floor measured at the start plus
  ``--quiet-cpu-pct`` (``serve_app.bench.cpu``), with a timeout the record keeps; a round one of
  whose batches shared the host with another process anyway is left out of the ratios.
- **CPU**: every process of each side (``serve_app.bench.procs``) is sampled before and after
  each counted batch, and every ``--quiet-window-s`` during it: CPU-seconds per 1,000 completion
  tokens per process group and side, and ours / baseline (``serve_app.bench.cpu.per_1k_tokens``),
  twice: under *steady load* (the samples inside the sustained window, over the tokens that
  arrived between them: ``cpu.steady_cpu``) and over the *whole batch* (ramp-up, tail and the
  quiet after it included). Both engines' niceness and thread settings are compared
  (``serve_app.bench.engine_env``).
- Ratios per concurrency: ours / baseline for aggregate, sustained and per-stream tok/s p50;
  TTFT overhead = ours − baseline at p50 and p95, in ms and in % of the baseline. Per round:
  sustained tok/s and CPU per token (steady load, whole batch) ours / baseline, and the TTFT
  overhead paired (ours − baseline of the two batches' p50s), with median and range over rounds
  (``stats.round_ratios``); ``--gate`` compares the tok/s median with its floors and fails on
  what it would not stand on (``serve_app.bench.gate``).

Targets must be 127.0.0.1 / localhost. Results go to ``docs/benchmarks/<region>-<UTC date>/<model>/``
(region: ``--region``, else the target's ``/health`` ``region``, else ``local``):
``llm_bench.json`` (meta, raw runs, summaries, batch records, ratios and their spread, CPU per
1,000 tokens, the engine environment, the gate), ``llm_bench.md`` (the card's table per side and
concurrency, summary, ratio, round, CPU, quiet and engine tables, ``cpu_report``), ``llm_bench.png``; ``bench-capacity`` writes
``router_capacity.json`` (``serve_app.bench.capacity`` defines its figures).
"""

from serve_app.bench.client import PROMPT, Run, check_local
from serve_app.bench.report import report
from serve_app.bench.stats import percentile
from serve_app.bench.streams import bench_target
from serve_app.bench.vllm import bare_vllm, free_port, wait_healthy

__all__ = ["PROMPT", "Run", "bare_vllm", "bench_target", "check_local", "free_port", "percentile", "report", "wait_healthy"]

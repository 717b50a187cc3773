"""`radixmesh bench`: an OpenAI-compatible load generator (any server: ours, llama-server, vLLM...).

Module map (one concept per file):
  config.py    BenchConfig: every flag, validated; the SLO parser
  words.py     WordPool: prompt text whose token count is exact under a local tokenizer
  datasets.py  the four workloads as lists of Conversation (random, sharegpt-like,
               generated-shared-prefix, multi-turn)
  arrivals.py  when each conversation starts (Poisson at --request-rate, or all at once)
  client.py    one streamed request → RequestResult; the SSE parser (pure, tested on recordings)
  driver.py    runs conversations against a server: arrivals, --max-concurrency, progress bar
  metrics.py   RequestResults → the summary (TTFT, TPOT, ITL, E2E, throughput, goodput, hit rate)
  report.py    the printed table and the JSON document
  compare.py   the same workload against two servers, interleaved in rounds; the ratios
  plot.py      the PNG (latency CDFs, throughput over time); matplotlib imported lazily
  cli.py       main(argv) for `radixmesh bench`

Library use (bench/peers.py does this):

    from services.loadgen.config import BenchConfig
    from services.loadgen.cli import run_bench
    doc = run_bench(BenchConfig(base_url="http://127.0.0.1:8080", dataset="random", num_prompts=16))
"""

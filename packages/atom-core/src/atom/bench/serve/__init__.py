"""`atom bench serve`: any OpenAI-compatible server under a Poisson request-rate sweep.

workloads.py makes the requests (token-id prompts, so no tokenizer is needed on either
side), arrivals.py their send times, client.py streams one request and times its chunks,
sweep.py runs a rate under a concurrency cap, metrics.py turns timings into TTFT / TPOT /
ITL percentiles, throughput and goodput, report.py and plot.py write the table, JSON and
PNG. run.py is the command; suite.py (`atom bench serve-suite`) starts each engine's
server in turn (servers.py) and runs the same sweep against it.
"""

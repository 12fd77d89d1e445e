"""The decision table: for bf16, every served dtype and every peer format, the numbers a user picks a KV cache dtype
by (bytes per token, capacity, attention error, perplexity, needles, greedy agreement, the KL kit), each read from
the newest result file that measured it; and the Pareto front of quality against bytes.

sources.py reads and dates the result files, cells.py the table's cells, front.py the Pareto front, missing.py the
commands that measure a missing cell, render.py the Markdown, plot.py the figure; `sgl-kvq bench decision`
(bench/commands/bench_decision.py) writes them."""

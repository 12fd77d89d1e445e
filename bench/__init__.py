"""The tooling around sgl_kvq, installed by the same project: the `sgl-kvq` command line (cli.py, commands/),
quality evaluations (eval/) and the sequence-level reference quantizers they score (quant/), the decision table
(decision/), the soak and workload drivers, plots, the server launchers (launch, pd_launch), the embedded models and
data, and the kernel and decode benchmarks (kernels.py, decode_work.py, ...) with their committed results (results/).

It imports the product; the product never imports it: no server process loads this package (SGLang's plugin entry
point `sgl_kvq.patches:load`, the pool and the attention backends import only sgl_kvq). The layer contract in
pyproject.toml ([tool.importlinter]) and tests/unit/test_product_imports.py hold it."""

"""The tooling around the product: the `sgl-kvq` commands (commands/), quality evaluations (eval/), the soak and
workload drivers, plots, the server launchers (launch, pd_launch) and the embedded models and data.

No server process imports this package: SGLang's plugin entry point (`sgl_kvq.patches:load`), the pool and the
attention backends import only the product (tests/unit/test_product_imports.py holds it)."""

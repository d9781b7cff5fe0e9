"""The toolbox beside the core: the `fp8train` command (demo, report, bench, info), the demo GPT and its
data, the benchmark suites, and the multi-rank launcher the tests and benchmarks share.

The core package (`import fp8train`) never imports this subpackage; the demo and report need the
`demo` extra (`pip install "fp8train[demo]"`: matplotlib, tqdm), which the command names when missing.
"""

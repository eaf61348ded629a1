"""`flashkd bench`: time and measure fused distillation losses against the naive torch formula,
Liger-Kernel and the GEMM floor, on the same inputs in one process, after a correctness gate.

    workloads.py   Workload (one bound case), presets, seeded input generation
    providers.py   PROVIDERS: name -> Provider(make, version); make(workload, inputs) -> loss closure
    measure.py     fp32 reference, correctness gate, timing (do_bench / wall clock), peak memory
    report.py      terminal table, results.csv (Liger's 15 columns), errors.csv, PNG plots
    cli.py         `flashkd bench ...` (main) and `python -m flashkd.bench ...` (bench_main)
"""

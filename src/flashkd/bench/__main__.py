"""python -m flashkd.bench [options]  (the same as `flashkd bench [options]`)."""

from .cli import bench_main

if __name__ == "__main__":
    raise SystemExit(bench_main())

"""Benchmark records in the KernelIndex format (kernelindex.dev/v1alpha1).

    digest(manifest)                 content digest of a manifest (RFC 8785 JSON of apiVersion, kind, spec)
    correctness_key(workload)        key of a WorkloadCase's correctness policy
    comparison_key(run, workload, protocol, environment)   the run's comparison group
    bundles_from_results(results, env)   the bench harness's results as bundles (flashkd.records.emit)
    write_bundles(bundles, folder)   one JSON file per bundle
    add_records_parser(commands)     the `flashkd records` command (import-liger, verify, compare)

The JSON Schemas in schemas/ are KernelIndex's (Apache-2.0, see schemas/NOTICE).
"""

from .cli import add_records_parser, write_bundles
from .identity import canonical_json, comparison_key, comparison_key_of, correctness_key, digest, normalize
from .verify import check_bundle


def bundles_from_results(*args, **kwargs):
    """See flashkd.records.emit.bundles_from_results (imports torch and the bench harness)."""
    from .emit import bundles_from_results as emit

    return emit(*args, **kwargs)


__all__ = ["digest", "correctness_key", "comparison_key", "comparison_key_of", "canonical_json", "normalize",
           "check_bundle", "bundles_from_results", "add_records_parser", "write_bundles"]

"""Benchmark records in the KernelIndex format (kernelindex.dev/v1alpha1).

    digest(manifest)                 content digest of a manifest (RFC 8785 JSON of apiVersion, kind, spec)
    correctness_key(workload)        key of a WorkloadCase's correctness policy
    comparison_key(run, workload, protocol, environment)   the run's comparison group
    bundles_from_results(results, env)   the bench harness's results as bundles (flashkd.records.emit)
    write_bundles(bundles, folder)   one JSON file per bundle
    add_records_parser(commands)     the `flashkd records` command (import-liger, verify, compare)

The JSON Schemas in schemas/ are KernelIndex's (Apache-2.0, see schemas/NOTICE).
"""

import importlib

# Each name from its module at first use (PEP 562): the `flashkd records` parser (flashkd.records.cli) is
# read before the extra's packages (rfc8785, jsonschema, jinja2) are known to be installed.
_MODULE_OF = {
    "add_records_parser": "cli", "write_bundles": "cli", "check_bundle": "verify",
    "bundles_from_results": "emit",  # imports torch and the bench harness
    **dict.fromkeys(("canonical_json", "comparison_key", "comparison_key_of", "correctness_key", "digest",
                     "normalize"), "identity"),
}


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
    globals()[name] = value
    return value


__all__ = ["digest", "correctness_key", "comparison_key", "comparison_key_of", "canonical_json", "normalize",
           "check_bundle", "bundles_from_results", "add_records_parser", "write_bundles"]

"""The failure analysis, in small modules: rules (the causal rules of data/rules.yaml, typed),
timeorder (ordering events of different clocks), deaths (signals and process names of death
records), demote (the rule kinds applied to root candidates). `xpu_serve.diagnosis` is the
entry point (Analyzer, diagnose_files); docs/analysis.md describes the whole."""

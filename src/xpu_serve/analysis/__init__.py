"""The failure analysis, in small modules (docs/analysis.md): rules (the causal rules of
data/rules.yaml, typed), traceback (the per-stream traceback tracker), store (the bounded
evidence store), subject (whose record it is), demote (the rule kinds applied to root
candidates), verdict (the verdict's steps), contract (the `--json` contract at the edge), incident
(the verdict's types), timeorder and deaths (shared helpers). `xpu_serve.diagnosis` is the entry
point (Analyzer, diagnose_files)."""

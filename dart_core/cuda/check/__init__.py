"""The GPU check (`dart-gpu-check`, cli.py): where the engine stands on a CUDA GPU, in stages of a module
each (env, exact, sampling, big with its gemm part, profile, embedded), their shared report and helpers
(common.py), the targets read off a report (report.py), each piece in a process of its own
(isolate.py), and the embedded model carried in parts to a machine without network access (parts.py)."""

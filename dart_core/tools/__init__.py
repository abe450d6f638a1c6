"""The tools built on the engine: the benchmark (bench, methods, peers), this machine's calibration
(calibrate), exact replay and what is measured with it (replay, tuning, fitting, fidelity), the
training pipeline (training, data) and the exports (export_gguf, export_upstream). The engine
(dart_core's other modules) imports none of them; the command lines (dart_core/cli) sit on both."""

"""Everything of the engine that exists only for CUDA: the fixed-shape forward's Triton kernels and the
forward captured as a CUDA graph (forward.py, triton_kernels.py), the draft heads' captured forwards
(head_graph.py, expand_graph.py), their one setting (config.py: CudaForward and the forward paths'
names), and the GPU check (check/: `dart-gpu-check`). The CPU engine does not import it: the torch
side of the fixed-shape forward is dart_core/fixed_shape.py, which reaches here only where
fixed_shape.cuda_asked says the device (or a demand) needs it."""

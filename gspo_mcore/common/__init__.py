"""What every part of the project leans on and none owns: errors and how commands report them,
whole-or-nothing files, child processes, JSON over HTTP, addresses, config-named plugins,
safetensors I/O, and the deprecation of moved import paths."""

# malloc_keep.sh - sourced by the benchmarks that run PyTorch: the
# environment that tells glibc's malloc to keep what PyTorch frees. PyTorch
# allocates its buffers anew every step and glibc hands the big ones back to
# the kernel (mmap threshold, trimming); on a VM where a page fault is slow
# and its cost varies, PyTorch's speed then follows the page faults. The
# benchmarks run PyTorch both ways and compare stoke with the faster.
# shellcheck disable=SC2034 # used by the scripts that source this file
KEEP=(MALLOC_MMAP_THRESHOLD_=4000000000 MALLOC_TRIM_THRESHOLD_=100000000000
    MALLOC_TOP_PAD_=1000000000)

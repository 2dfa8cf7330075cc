// hold.cu — keeps a stream busy while `cupydecode bench` queues what it times (not part of
// decoding).
//
// A CUDA event recorded on an idle stream fires as soon as the host submits it, so the host's
// time to submit the graph launch that follows would land inside the timed interval (measured on
// the H200: the read-ceiling probe read 1.6–2.5% slow that way; the performance log, v11). The
// benchmark starts this kernel first: by the time it ends, the start event and the timed work are
// queued behind it and run back to back. One thread spins on the global nanosecond timer.

extern "C" __global__ void cd_hold(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}

// The yardstick of the host cost that `cupydecode bench` reports: CuPy's own launch of a kernel
// that does nothing, timed in the same process as flash_decode and DecodePlan.run.
extern "C" __global__ void cd_empty() {}

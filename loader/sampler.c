/* sampler.c - DistributedSampler semantics: a permutation per (seed, epoch),
 * padded by wrapping around (or trimmed, or left uneven), and rank r taking
 * every world-th index from r.
 *
 * The permutation is Fisher-Yates (Durstenfeld) over 0..n-1, drawing from
 * SplitMix64 started at mix(seed, epoch), with Lemire's unbiased bounded
 * integers. It does not reproduce torch.randperm; it is documented in
 * docs/loader.md so that any implementation can reproduce it. */
#include "loader.h"

#include <stdlib.h>

static uint64_t splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform integer in [0, bound), bound >= 1 (Lemire 2019). */
static uint64_t bounded(uint64_t *state, uint64_t bound)
{
    unsigned __int128 m = (unsigned __int128)splitmix64(state) * bound;
    uint64_t low = (uint64_t)m;
    if (low < bound) {
        uint64_t threshold = -bound % bound;
        while (low < threshold) {
            m = (unsigned __int128)splitmix64(state) * bound;
            low = (uint64_t)m;
        }
    }
    return (uint64_t)(m >> 64);
}

uint64_t stk_sampler_len(const stk_sampler *s)
{
    uint64_t w = s->world > 0 ? (uint64_t)s->world : 1;
    if (s->uneven)
        return s->n / w + ((uint64_t)s->rank < s->n % w);
    if (s->drop_last)
        return s->n / w;
    return (s->n + w - 1) / w;
}

int stk_sampler_shard(const stk_sampler *s, uint64_t epoch, uint64_t *out)
{
    uint64_t w = s->world > 0 ? (uint64_t)s->world : 1;
    uint64_t len = stk_sampler_len(s);
    if (s->rank < 0 || (uint64_t)s->rank >= w)
        return STK_EINVAL;
    if (!s->n || !len)
        return 0;
    uint64_t *perm = malloc(s->n * sizeof *perm);
    if (!perm)
        return STK_ENOMEM;
    for (uint64_t i = 0; i < s->n; i++)
        perm[i] = i;
    if (s->shuffle) {
        uint64_t state = s->seed;
        state = splitmix64(&state) ^ (epoch * 0xd1b54a32d192ed03ull);
        for (uint64_t i = s->n - 1; i > 0; i--) {
            uint64_t j = bounded(&state, i + 1);
            uint64_t t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
    }
    /* position g of the padded sequence is perm[g mod n] */
    for (uint64_t j = 0; j < len; j++)
        out[j] = perm[((uint64_t)s->rank + j * w) % s->n];
    free(perm);
    return 0;
}

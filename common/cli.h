/* cli.h - flag values for the tools' mains (prep, sweep, train, ...). Each
 * parser checks one value and, when it is bad, prints one line naming the
 * tool, the flag, what was expected and what was given, and returns -1.
 * Only mains use this; library code never prints. */
#ifndef STK_CLI_H
#define STK_CLI_H

#include <stddef.h>
#include <stdint.h>

/* A whole number in lo..hi. */
int stk_cli_int(const char *tool, const char *flag, const char *s, long lo,
                long hi, int *out);

/* A whole number 0..2^64-1 written in decimal digits only: no sign, no
 * blanks (strtoull alone would take "-1" as 2^64-1), e.g. a seed. */
int stk_cli_u64(const char *tool, const char *flag, const char *s,
                uint64_t *out);

/* A number in [lo, hi]. */
int stk_cli_float(const char *tool, const char *flag, const char *s,
                  double lo, double hi, float *out);

/* One of n names; *out is its index. */
int stk_cli_choice(const char *tool, const char *flag, const char *s,
                   const char *const *names, int n, int *out);

/* A comma-separated list of whole numbers in lo..hi, at most max of them,
 * such as "0,1,2,4", into out[0..*n-1]. An empty item (",1", "1,,2", "1,",
 * "") is refused, naming the flag and the whole value; a bad item is named
 * as stk_cli_int names it. */
int stk_cli_int_list(const char *tool, const char *flag, const char *s,
                     long lo, long hi, int *out, int max, int *n);

/* A byte count with an optional K/M/G/T suffix (powers of 1024). */
int stk_cli_bytes(const char *tool, const char *flag, const char *s,
                  size_t *out);

#endif

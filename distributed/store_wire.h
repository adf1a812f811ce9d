/* store_wire.h - the rendezvous store's wire format, shared by its server
 * (store_server.c) and its client (store.c).
 *
 * Little-endian. A request is op (u8), key length (u32), key, value length
 * (u32), value. A reply starts with a status byte (STORE_OK, or
 * STORE_NOT_COUNTER, STORE_NO_MEMORY); GET adds the value's length (u32)
 * and bytes, ADD the new int64. A GET on a missing key is parked until some
 * SET or ADD creates it; the client bounds its own wait and drops the
 * connection on timeout, which discards the parked request. */
#ifndef STK_STORE_WIRE_H
#define STK_STORE_WIRE_H

enum { OP_SET = 1, OP_GET = 2, OP_ADD = 3 };
enum { STORE_OK = 0, STORE_NOT_COUNTER = 1, STORE_NO_MEMORY = 2 };

/* The default limits on a key and a value, which the client checks too:
 * torch's libuv TCPStore allows 8 KiB keys and 8 MiB values; stoke's keys
 * are short names, its largest value NCCL's 128-byte unique id. */
enum { STORE_MAX_KEY = 4096, STORE_MAX_VALUE = 8 << 20 };

#endif

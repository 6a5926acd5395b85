"""h2raw.py - a minimal raw HTTP/2 client for abuse tests (no HPACK Huffman, no flow control).

Only what the tests need: the preface, SETTINGS, HEADERS (literal fields without
indexing), DATA, RST_STREAM, PING and a reader thread that counts the server's frames and
records GOAWAY error codes."""
import socket
import struct
import threading

DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
CANCEL = 0x8
GOAWAY_NAMES = {0: "NO_ERROR", 1: "PROTOCOL_ERROR", 2: "INTERNAL_ERROR", 11: "ENHANCE_YOUR_CALM"}


def _hpack_int(v, prefix_bits):
    top = (1 << prefix_bits) - 1
    if v < top:
        return bytes([v])
    out = [top]
    v -= top
    while v >= 128:
        out.append((v & 127) | 128)
        v >>= 7
    out.append(v)
    return bytes(out)


def hpack_literal(headers):
    out = bytearray()
    for name, value in headers:
        n, v = name.encode(), value.encode()
        out += b"\x00" + _hpack_int(len(n), 7) + n + _hpack_int(len(v), 7) + v
    return bytes(out)


def frame(ftype, flags, stream, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([ftype, flags]) + struct.pack(">I", stream) + payload


def grpc_message(raw):
    return b"\x00" + struct.pack(">I", len(raw)) + raw


class Conn:
    def __init__(self, port, host="127.0.0.1"):
        self.port = port
        self.sock = socket.create_connection((host, port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.next_id = 1
        self.frames = {}
        self.goaway = []
        self.closed = False
        self.ended = None       # why the reader stopped: "eof", "reset" (by the server) or "timeout"
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.settings_acked = 0     # the server's SETTINGS frames acknowledged
        self.sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(SETTINGS, 0, 0) +
                          frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 30)))
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _recv_exact(self, n):
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf

    def _read(self):
        try:
            while True:
                hdr = self._recv_exact(9)
                ln = struct.unpack(">I", b"\x00" + hdr[:3])[0]
                ftype, flags = hdr[3], hdr[4]
                payload = self._recv_exact(ln) if ln else b""
                with self.lock:
                    self.frames[ftype] = self.frames.get(ftype, 0) + 1
                if ftype == SETTINGS and not flags & ACK:
                    self.send(frame(SETTINGS, ACK, 0))
                    self.settings_acked += 1
                elif ftype == GOAWAY:
                    self.goaway.append(struct.unpack(">I", payload[4:8])[0])
                elif ftype == PING and not flags & ACK:
                    self.send(frame(PING, ACK, 0, payload))
        except EOFError:
            self.ended = "eof"
        except socket.timeout:
            self.ended = "timeout"
        except OSError:
            self.ended = "reset"
        self.closed = True

    def send(self, data):
        # one writer at a time: the reader thread's SETTINGS/PING acks must not land in the
        # middle of a frame the test is sending (the server would see a framing error)
        try:
            with self.send_lock:
                self.sock.sendall(data)
            return True
        except OSError:
            self.closed = True
            return False

    def headers(self, path, authority, end_stream=False):
        sid = self.next_id
        self.next_id += 2
        block = hpack_literal([(":method", "POST"), (":scheme", "http"), (":path", path),
                               (":authority", authority), ("content-type", "application/grpc"), ("te", "trailers")])
        return sid, frame(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), sid, block)

    def close(self):
        # shutdown first: a plain close() while the reader thread sits in recv() keeps the
        # file open (no FIN) until that recv times out
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass

//! The part of the kernel's FUSE protocol (`include/uapi/linux/fuse.h`) the
//! native plane answers itself: the request header, the bodies of LOOKUP,
//! GETATTR, OPEN, READ, RELEASE, FLUSH, READDIRPLUS, RELEASEDIR and the
//! FORGETs, and the replies that carry an entry, an attribute, an open
//! file, directory entries or data. Pure functions over bytes: every other request is
//! handed to Python whole, and Python's `fuse/protocol.py` speaks it.
//!
//! Every structure is little-endian with 64-bit alignment, as the header
//! pads them; the sizes below are the kernel's (unit tests check the
//! offsets, Python's `tests/contract/test_fuse_protocol.py` the C header).

/// Operation codes this plane looks at.
const LOOKUP: u32 = 1;
const FORGET: u32 = 2;
const GETATTR: u32 = 3;
const OPEN: u32 = 14;
const READ: u32 = 15;
const RELEASE: u32 = 18;
const FLUSH: u32 = 25;
const RELEASEDIR: u32 = 29;
const INTERRUPT: u32 = 36;
const IOCTL: u32 = 39;
const BATCH_FORGET: u32 = 42;
const READDIRPLUS: u32 = 44;

const IN_HEADER_SIZE: usize = 40;
const OUT_HEADER_SIZE: usize = 16;
const ATTR_SIZE: usize = 88;
const ENTRY_OUT_SIZE: usize = 40 + ATTR_SIZE;
const ATTR_OUT_SIZE: usize = 16 + ATTR_SIZE;
const READ_IN_SIZE: usize = 40;
const OPEN_IN_SIZE: usize = 8;
const OPEN_OUT_SIZE: usize = 16;
/// `struct fuse_dirent` before its name: ino, off, namelen, type.
const DIRENT_SIZE: usize = 24;
/// RELEASE's and FLUSH's bodies: the handle first, then fields not read here.
const HANDLE_IN_SIZE: usize = 24;
const FORGET_ONE_SIZE: usize = 16;
const BATCH_FORGET_IN_SIZE: usize = 8;
/// An open's answer flags (`FOPEN_*`): keep the inode's pages (they are
/// of one version), or read and write the backing file given.
pub const FOPEN_KEEP_CACHE: u32 = 1 << 1;
pub const FOPEN_PASSTHROUGH: u32 = 1 << 7;
/// `st_blksize` the kernel is told: the page size.
const BLOCK_SIZE_HINT: u32 = 4096;

/// Why a request cannot be decoded: the kernel never sends one, so it is
/// handed to Python, whose answer (EIO or ENOSYS) is the protocol's.
#[derive(Debug, PartialEq, Eq)]
pub struct Malformed;

fn u32_at(bytes: &[u8], at: usize) -> Result<u32, Malformed> {
    let field = bytes.get(at..at + 4).ok_or(Malformed)?;
    Ok(u32::from_le_bytes(field.try_into().map_err(|_| Malformed)?))
}

fn u64_at(bytes: &[u8], at: usize) -> Result<u64, Malformed> {
    let field = bytes.get(at..at + 8).ok_or(Malformed)?;
    Ok(u64::from_le_bytes(field.try_into().map_err(|_| Malformed)?))
}

/// What every request says (`struct fuse_in_header`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub pid: u32,
}

/// A request read from the device: its header and its body, checked
/// against the length the header claims.
fn parse(message: &[u8]) -> Result<(Header, &[u8]), Malformed> {
    let length = u32_at(message, 0)? as usize;
    if length < IN_HEADER_SIZE || length > message.len() {
        return Err(Malformed);
    }
    let header = Header {
        opcode: u32_at(message, 4)?,
        unique: u64_at(message, 8)?,
        nodeid: u64_at(message, 16)?,
        pid: u32_at(message, 32)?,
    };
    Ok((header, &message[IN_HEADER_SIZE..length]))
}

/// A request as the native plane sees it: the ones it may answer, decoded;
/// every other one is `Other`, for Python.
#[derive(Debug, PartialEq, Eq)]
pub enum Request<'a> {
    Lookup {
        name: &'a [u8],
    },
    Getattr,
    Open {
        flags: u32,
    },
    /// `fh` is the handle the open was answered with.
    Release {
        fh: u64,
    },
    Flush {
        fh: u64,
    },
    /// `fh` is the listing's handle; `offset` the index of its next entry.
    Readdirplus {
        fh: u64,
        offset: u64,
        size: u32,
    },
    Releasedir {
        fh: u64,
    },
    Read {
        offset: u64,
        size: u32,
    },
    Forget {
        count: u64,
    },
    BatchForget {
        pairs: Vec<(u64, u64)>,
    },
    Interrupt,
    /// Sent at every open by a program that asks whether the file is a
    /// terminal (Python's `open` does); the kernel does not remember that
    /// none is implemented.
    Ioctl,
    Other,
}

/// A message read from the device, decoded. Malformed: the kernel never
/// sends such a message; it is handed to Python as it came.
pub fn decode(message: &[u8]) -> Result<(Header, Request<'_>), Malformed> {
    let (header, body) = parse(message)?;
    let request = match header.opcode {
        LOOKUP => Request::Lookup { name: name(body)? },
        GETATTR => Request::Getattr,
        OPEN => Request::Open {
            flags: open_flags(body)?,
        },
        RELEASE => Request::Release { fh: handle(body)? },
        FLUSH => Request::Flush { fh: handle(body)? },
        READDIRPLUS => {
            let (offset, size) = read_range(body)?;
            Request::Readdirplus {
                fh: handle(body)?,
                offset,
                size,
            }
        }
        RELEASEDIR => Request::Releasedir { fh: handle(body)? },
        READ => {
            let (offset, size) = read_range(body)?;
            Request::Read { offset, size }
        }
        FORGET => Request::Forget {
            count: forget_count(body)?,
        },
        BATCH_FORGET => Request::BatchForget {
            pairs: batch_forget(body)?,
        },
        INTERRUPT => Request::Interrupt,
        IOCTL => Request::Ioctl,
        _ => Request::Other,
    };
    Ok((header, request))
}

/// The NUL-terminated name a LOOKUP's body holds.
fn name(body: &[u8]) -> Result<&[u8], Malformed> {
    let end = body.iter().position(|&byte| byte == 0).ok_or(Malformed)?;
    Ok(&body[..end])
}

/// An OPEN's flags (`struct fuse_open_in`: the open(2) flags first).
fn open_flags(body: &[u8]) -> Result<u32, Malformed> {
    if body.len() < OPEN_IN_SIZE {
        return Err(Malformed);
    }
    u32_at(body, 0)
}

/// The handle a RELEASE or FLUSH names (`struct fuse_release_in`, `fuse_flush_in`).
fn handle(body: &[u8]) -> Result<u64, Malformed> {
    if body.len() < HANDLE_IN_SIZE {
        return Err(Malformed);
    }
    u64_at(body, 0)
}

/// A READ's range (`struct fuse_read_in`): its offset and size.
fn read_range(body: &[u8]) -> Result<(u64, u32), Malformed> {
    if body.len() < READ_IN_SIZE {
        return Err(Malformed);
    }
    Ok((u64_at(body, 8)?, u32_at(body, 16)?))
}

/// A FORGET's count of references (`struct fuse_forget_in`).
fn forget_count(body: &[u8]) -> Result<u64, Malformed> {
    u64_at(body, 0)
}

/// A BATCH_FORGET's (nodeid, count) pairs.
fn batch_forget(body: &[u8]) -> Result<Vec<(u64, u64)>, Malformed> {
    let count = u32_at(body, 0)? as usize;
    let pairs = body.get(BATCH_FORGET_IN_SIZE..).ok_or(Malformed)?;
    if pairs.len() / FORGET_ONE_SIZE < count {
        return Err(Malformed);
    }
    (0..count)
        .map(|index| {
            let at = index * FORGET_ONE_SIZE;
            Ok((u64_at(pairs, at)?, u64_at(pairs, at + 8)?))
        })
        .collect()
}

/// What the kernel is told of an inode (`struct fuse_attr`), as Python's
/// `protocol.Attr` says it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Attr {
    pub ino: u64,
    pub size: u64,
    pub mtime: f64,
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
}

/// Whole seconds and nanoseconds of a time or timeout, truncated as
/// Python's `protocol.pack_attr` truncates them.
fn seconds(value: f64) -> (u64, u32) {
    let whole = value.trunc();
    (whole as u64, ((value - whole) * 1e9) as u32)
}

fn pack_attr(out: &mut Vec<u8>, attr: &Attr) {
    let (mtime, mtime_ns) = seconds(attr.mtime);
    for field in [
        attr.ino,
        attr.size,
        attr.size.div_ceil(512),
        mtime,
        mtime,
        mtime,
    ] {
        out.extend_from_slice(&field.to_le_bytes());
    }
    let rdev_blksize_flags = [0, BLOCK_SIZE_HINT, 0];
    for field in [
        mtime_ns, mtime_ns, mtime_ns, attr.mode, attr.nlink, attr.uid, attr.gid,
    ]
    .into_iter()
    .chain(rdev_blksize_flags)
    {
        out.extend_from_slice(&field.to_le_bytes());
    }
}

fn out_header(out: &mut Vec<u8>, unique: u64, body_length: usize) {
    out.extend_from_slice(&((OUT_HEADER_SIZE + body_length) as u32).to_le_bytes());
    out.extend_from_slice(&0i32.to_le_bytes());
    out.extend_from_slice(&unique.to_le_bytes());
}

/// `struct fuse_entry_out`: `nodeid` with `attr`, both valid for `timeout` seconds.
fn pack_entry(out: &mut Vec<u8>, nodeid: u64, attr: &Attr, timeout: f64) {
    let (whole, nanos) = seconds(timeout);
    for field in [nodeid, 0, whole, whole] {
        out.extend_from_slice(&field.to_le_bytes());
    }
    out.extend_from_slice(&nanos.to_le_bytes());
    out.extend_from_slice(&nanos.to_le_bytes());
    pack_attr(out, attr);
}

/// The answer to a LOOKUP: `nodeid` with `attr`, both valid for `timeout` seconds.
pub fn entry_reply(unique: u64, nodeid: u64, attr: &Attr, timeout: f64) -> Vec<u8> {
    let mut out = Vec::with_capacity(OUT_HEADER_SIZE + ENTRY_OUT_SIZE);
    out_header(&mut out, unique, ENTRY_OUT_SIZE);
    pack_entry(&mut out, nodeid, attr, timeout);
    out
}

/// Bytes one READDIRPLUS entry of a `name_length`-byte name takes, padded to 8.
pub fn direntplus_size(name_length: usize) -> usize {
    (ENTRY_OUT_SIZE + DIRENT_SIZE + name_length).div_ceil(8) * 8
}

/// One READDIRPLUS entry (`struct fuse_direntplus`) onto `out`;
/// `next_offset` is where the one after it starts. The kernel makes no
/// dentry for `.` and `..`.
pub fn pack_direntplus(
    out: &mut Vec<u8>,
    nodeid: u64,
    attr: &Attr,
    timeout: f64,
    name: &[u8],
    next_offset: u64,
) {
    let start = out.len();
    pack_entry(out, nodeid, attr, timeout);
    out.extend_from_slice(&attr.ino.to_le_bytes());
    out.extend_from_slice(&next_offset.to_le_bytes());
    out.extend_from_slice(&(name.len() as u32).to_le_bytes());
    out.extend_from_slice(&((attr.mode & 0o170000) >> 12).to_le_bytes());
    out.extend_from_slice(name);
    out.resize(start + direntplus_size(name.len()), 0);
}

/// The header of an answer whose `length` bytes of body follow it.
pub fn reply_header(unique: u64, length: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(OUT_HEADER_SIZE + length);
    out_header(&mut out, unique, length);
    out
}

/// The answer to a GETATTR: `attr`, valid for `timeout` seconds.
pub fn attr_reply(unique: u64, attr: &Attr, timeout: f64) -> Vec<u8> {
    let mut out = Vec::with_capacity(OUT_HEADER_SIZE + ATTR_OUT_SIZE);
    out_header(&mut out, unique, ATTR_OUT_SIZE);
    let (whole, nanos) = seconds(timeout);
    out.extend_from_slice(&whole.to_le_bytes());
    out.extend_from_slice(&nanos.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    pack_attr(&mut out, attr);
    out
}

/// The answer to an OPEN (`struct fuse_open_out`): the handle, its flags,
/// and the backing file's id where passthrough serves it (else 0).
pub fn open_reply(unique: u64, fh: u64, open_flags: u32, backing_id: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(OUT_HEADER_SIZE + OPEN_OUT_SIZE);
    out_header(&mut out, unique, OPEN_OUT_SIZE);
    out.extend_from_slice(&fh.to_le_bytes());
    out.extend_from_slice(&open_flags.to_le_bytes());
    out.extend_from_slice(&backing_id.to_le_bytes());
    out
}

/// A successful answer with no body (RELEASE, FLUSH).
pub fn empty_reply(unique: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(OUT_HEADER_SIZE);
    out_header(&mut out, unique, 0);
    out
}

/// A failed answer: `errno`, as the kernel takes it (negated).
pub fn error_reply(unique: u64, errno: i32) -> Vec<u8> {
    let mut out = Vec::with_capacity(OUT_HEADER_SIZE);
    out.extend_from_slice(&(OUT_HEADER_SIZE as u32).to_le_bytes());
    out.extend_from_slice(&(-errno).to_le_bytes());
    out.extend_from_slice(&unique.to_le_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const ATTR: Attr = Attr {
        ino: 77,
        size: 1000,
        mtime: 1.5,
        mode: 0o100444,
        nlink: 1,
        uid: 10,
        gid: 20,
    };

    fn request(opcode: u32, nodeid: u64, body: &[u8]) -> Vec<u8> {
        let mut message = Vec::new();
        message.extend_from_slice(&((IN_HEADER_SIZE + body.len()) as u32).to_le_bytes());
        message.extend_from_slice(&opcode.to_le_bytes());
        message.extend_from_slice(&9u64.to_le_bytes());
        message.extend_from_slice(&nodeid.to_le_bytes());
        message.extend_from_slice(&[1, 0, 0, 0, 2, 0, 0, 0]); // uid, gid
        message.extend_from_slice(&4242u32.to_le_bytes());
        message.extend_from_slice(&[0; 4]); // total_extlen, padding
        message.extend_from_slice(body);
        message
    }

    #[test]
    fn a_header_says_its_operation_number_inode_and_caller() {
        let message = request(LOOKUP, 5, b"name\0");
        let (header, request) = decode(&message).unwrap();
        assert_eq!(
            header,
            Header {
                opcode: LOOKUP,
                unique: 9,
                nodeid: 5,
                pid: 4242
            }
        );
        assert_eq!(request, Request::Lookup { name: b"name" });
    }

    #[test]
    fn a_message_shorter_than_its_header_says_is_malformed() {
        let mut message = request(LOOKUP, 5, b"name\0");
        message.truncate(42);
        assert_eq!(decode(&message), Err(Malformed));
        assert_eq!(decode(&message[..10]), Err(Malformed));
        assert_eq!(decode(&request(LOOKUP, 5, b"no end")), Err(Malformed));
        assert_eq!(decode(&request(READ, 5, &[0; 39])), Err(Malformed));
        assert_eq!(decode(&request(99, 5, b"")).unwrap().1, Request::Other);
        assert_eq!(decode(&request(OPEN, 5, &[0; 7])), Err(Malformed));
        assert_eq!(decode(&request(RELEASE, 5, &[0; 23])), Err(Malformed));
    }

    #[test]
    fn an_open_says_its_flags_and_a_release_or_flush_its_handle() {
        let mut open = 0o2001u32.to_le_bytes().to_vec(); // O_WRONLY | O_APPEND
        open.extend_from_slice(&[0; 4]);
        assert_eq!(
            decode(&request(OPEN, 5, &open)).unwrap().1,
            Request::Open { flags: 0o2001 }
        );
        let mut release = 7u64.to_le_bytes().to_vec();
        release.extend_from_slice(&[0; 16]);
        assert_eq!(
            decode(&request(RELEASE, 5, &release)).unwrap().1,
            Request::Release { fh: 7 }
        );
        assert_eq!(
            decode(&request(FLUSH, 5, &release)).unwrap().1,
            Request::Flush { fh: 7 }
        );
        let reply = open_reply(9, 1, FOPEN_PASSTHROUGH, 3);
        assert_eq!(reply.len(), OUT_HEADER_SIZE + OPEN_OUT_SIZE);
        assert_eq!(u64_at(&reply, 16).unwrap(), 1);
        assert_eq!(u32_at(&reply, 24).unwrap(), FOPEN_PASSTHROUGH);
        assert_eq!(u32_at(&reply, 28).unwrap(), 3);
        assert_eq!(empty_reply(9).len(), OUT_HEADER_SIZE);
    }

    #[test]
    fn a_readdirplus_names_its_listing_and_a_direntplus_is_padded_to_eight_bytes() {
        let mut body = 3u64.to_le_bytes().to_vec(); // fh
        body.extend_from_slice(&2u64.to_le_bytes()); // offset
        body.extend_from_slice(&4096u32.to_le_bytes()); // size
        body.extend_from_slice(&[0; 20]);
        assert_eq!(
            decode(&request(READDIRPLUS, 5, &body)).unwrap().1,
            Request::Readdirplus {
                fh: 3,
                offset: 2,
                size: 4096
            }
        );
        assert_eq!(
            decode(&request(RELEASEDIR, 5, &body[..24])).unwrap().1,
            Request::Releasedir { fh: 3 }
        );
        let mut out = Vec::new();
        pack_direntplus(&mut out, 5, &ATTR, 1.0, b"abc", 7);
        assert_eq!(out.len(), direntplus_size(3));
        assert_eq!(out.len() % 8, 0);
        assert_eq!(direntplus_size(8), ENTRY_OUT_SIZE + DIRENT_SIZE + 8);
        let dirent = &out[ENTRY_OUT_SIZE..];
        assert_eq!(u64_at(dirent, 0).unwrap(), 77); // ino
        assert_eq!(u64_at(dirent, 8).unwrap(), 7); // the next entry's offset
        assert_eq!(u32_at(dirent, 16).unwrap(), 3); // namelen
        assert_eq!(u32_at(dirent, 20).unwrap(), 0o10); // DT_REG
        assert_eq!(&dirent[24..27], b"abc");
    }

    #[test]
    fn a_batch_forget_names_its_pairs_and_no_more_than_it_holds() {
        let mut body = Vec::new();
        body.extend_from_slice(&2u32.to_le_bytes());
        body.extend_from_slice(&0u32.to_le_bytes());
        for pair in [(3u64, 1u64), (4, 7)] {
            body.extend_from_slice(&pair.0.to_le_bytes());
            body.extend_from_slice(&pair.1.to_le_bytes());
        }
        assert_eq!(batch_forget(&body).unwrap(), vec![(3, 1), (4, 7)]);
        assert_eq!(batch_forget(&body[..20]), Err(Malformed));
    }

    #[test]
    fn replies_have_the_kernels_sizes_and_fields() {
        let entry = entry_reply(9, 5, &ATTR, 1.25);
        assert_eq!(entry.len(), OUT_HEADER_SIZE + ENTRY_OUT_SIZE);
        assert_eq!(u32_at(&entry, 0).unwrap() as usize, entry.len());
        assert_eq!(u64_at(&entry, 8).unwrap(), 9);
        assert_eq!(u64_at(&entry, 16).unwrap(), 5); // nodeid
        assert_eq!(u64_at(&entry, 32).unwrap(), 1); // entry_valid
        assert_eq!(u32_at(&entry, 48).unwrap(), 250_000_000); // entry_valid_nsec
        let attr = &entry[OUT_HEADER_SIZE + 40..];
        assert_eq!(u64_at(attr, 0).unwrap(), 77);
        assert_eq!(u64_at(attr, 8).unwrap(), 1000);
        assert_eq!(u64_at(attr, 16).unwrap(), 2); // 512-byte blocks
        assert_eq!(u64_at(attr, 32).unwrap(), 1); // mtime
        assert_eq!(u32_at(attr, 52).unwrap(), 500_000_000); // mtimensec
        assert_eq!(u32_at(attr, 60).unwrap(), 0o100444);
        assert_eq!(u32_at(attr, 80).unwrap(), BLOCK_SIZE_HINT);
        let reply = attr_reply(9, &ATTR, 2.0);
        assert_eq!(reply.len(), OUT_HEADER_SIZE + ATTR_OUT_SIZE);
        assert_eq!(u64_at(&reply, 16).unwrap(), 2);
        assert_eq!(reply_header(9, 100)[..4], 116u32.to_le_bytes());
        let error = error_reply(9, 38);
        assert_eq!(
            (error.len(), &error[4..8]),
            (OUT_HEADER_SIZE, &(-38i32).to_le_bytes()[..])
        );
    }
}

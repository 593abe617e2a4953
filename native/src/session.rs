//! One mount's FUSE session, served on native threads.
//!
//! Each worker reads the kernel's requests from a descriptor of its own (a
//! clone of the connection) and answers what `Tables` knows: LOOKUP of a
//! fresh name, GETATTR of a version, READ of blocks in verified cache
//! files (past the page cache), OPEN of a version for reading (in
//! passthrough on its whole file, by the rules of `opens.rs`, as the open
//! mode Python set says), RELEASE and FLUSH of such opens, READDIRPLUS
//! and RELEASEDIR of a listing Python took, the FORGETs (counted here) and
//! INTERRUPT (a request is interrupted by answering it). Every other
//! request is handed to Python whole (`next_request`), with the descriptor
//! its answer goes back through, one request a call: an OPENDIR, a write,
//! a staged file, a block no file holds, an open while the mount's files
//! are judged. A request wakes one waiting worker (`device::Waiter`).
//!
//! A request is answered once: natively, or by Python. A native answer
//! that fails half way (a cache file gone or changed, a short read) has
//! sent nothing yet, so the request goes to Python as it came.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, IoSlice, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::abi::{self, Request};
use crate::device::{self, Backing};
use crate::opens::{Begin, Opened, Opens};
use crate::reports::{self, OpenReport, ReadReport, Reports};
use crate::tables::{BlockFile, FileIdentity, Piece, Tables};

/// Cache files are read past the page cache (O_DIRECT) where the
/// filesystem takes it: the kernel keeps the bytes in the mounted file's
/// own pages, and the cache file's would be a second copy, made and then
/// dropped. O_DIRECT wants the file offset, the length and the buffer
/// aligned to the disk's logical block, which a page is for every disk.
const DIRECT_ALIGNMENT: usize = 4096;

/// The handle of a cached open and of a passthrough one (Python's
/// `session._THROUGH`); a larger one is a staged file's, Python's.
const CACHED_HANDLE: u64 = 0;
const THROUGH_HANDLE: u64 = 1;

/// How OPEN is answered, as Python decides (`Session.set_open_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum OpenMode {
    /// Python answers every OPEN (before INIT, and while it judges the
    /// mount's files).
    Python = 0,
    /// Passthrough on: a version's whole file is handed over.
    Through = 1,
    /// Passthrough off: cached opens that keep the inode's pages.
    Cached = 2,
    /// Passthrough off on a kernel that opens files without asking: ENOSYS
    /// tells it so.
    NoOpen = 3,
}

impl OpenMode {
    fn from_u8(value: u8) -> Self {
        match value {
            1 => OpenMode::Through,
            2 => OpenMode::Cached,
            3 => OpenMode::NoOpen,
            _ => OpenMode::Python,
        }
    }
}

/// A request for Python: the descriptor it was read from, and its bytes.
pub struct Handed {
    pub fd: RawFd,
    pub message: Vec<u8>,
}

struct Shared {
    tables: Arc<Tables>,
    reports: Arc<Reports>,
    opens: Arc<Opens<Backing>>,
    open_mode: AtomicU8,
    /// A writable mount's FLUSH of a staged file is Python's; a read-only
    /// mount implements none.
    writable: bool,
    handed: Mutex<VecDeque<Handed>>,
    handed_ready: Condvar,
    ended: AtomicBool,
    end: OwnedFd,
    failure: Mutex<Option<String>>,
}

impl Shared {
    fn handed(&self) -> MutexGuard<'_, VecDeque<Handed>> {
        // Pushes and pops only: a panic leaves the queue whole.
        self.handed
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn finish(&self, failure: Option<String>) {
        if let Some(why) = failure {
            self.failure
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .get_or_insert(why);
        }
        self.ended.store(true, Ordering::SeqCst);
        // The eventfd stays readable once written: every worker wakes.
        let _ = device::signal(&self.end);
        let _lock = self.handed();
        self.handed_ready.notify_all();
    }
}

pub struct Session {
    shared: Arc<Shared>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    /// The workers' descriptors, open until `join`: Python answers a
    /// request it was handed through the descriptor it came from, which a
    /// worker that ended must not have closed (its number would be another
    /// file's by then).
    devices: Mutex<Vec<Arc<File>>>,
}

impl Session {
    /// Serve the connection of `session_fd` on `workers` threads, each
    /// reading requests into a buffer of `request_buffer` bytes, telling
    /// `reports` what they did.
    pub fn start(
        session_fd: RawFd,
        tables: Arc<Tables>,
        reports: Arc<Reports>,
        writable: bool,
        workers: usize,
        request_buffer: usize,
    ) -> io::Result<Self> {
        let devices = (0..workers)
            .map(|_| device::clone_connection(session_fd))
            .collect::<io::Result<Vec<File>>>()?;
        let shared = Arc::new(Shared {
            tables,
            reports,
            opens: Arc::new(Opens::new(Backing::new(session_fd)?)),
            open_mode: AtomicU8::new(OpenMode::Python as u8),
            writable,
            handed: Mutex::new(VecDeque::new()),
            handed_ready: Condvar::new(),
            ended: AtomicBool::new(false),
            end: device::event()?,
            failure: Mutex::new(None),
        });
        let devices: Vec<Arc<File>> = devices.into_iter().map(Arc::new).collect();
        let workers = devices
            .iter()
            .map(|device| Worker::new(Arc::clone(&shared), Arc::clone(device), request_buffer))
            .collect::<io::Result<Vec<Worker>>>()?;
        let threads = workers
            .into_iter()
            .enumerate()
            .map(|(number, worker)| {
                std::thread::Builder::new()
                    .name(format!("cachefsd-native-{number}"))
                    .spawn(move || worker.run())
            })
            .collect::<io::Result<Vec<_>>>()?;
        Ok(Session {
            shared,
            workers: Mutex::new(threads),
            devices: Mutex::new(devices),
        })
    }

    /// The next request only Python answers; None once the session ended.
    pub fn next_request(&self) -> Option<Handed> {
        let mut handed = self.shared.handed();
        loop {
            if let Some(request) = handed.pop_front() {
                return Some(request);
            }
            if self.shared.ended.load(Ordering::SeqCst) {
                return None;
            }
            handed = self
                .shared
                .handed_ready
                .wait(handed)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }

    /// The open files of the connection's inodes, and their backing ids.
    pub fn opens(&self) -> Arc<Opens<Backing>> {
        Arc::clone(&self.shared.opens)
    }

    pub fn set_open_mode(&self, mode: OpenMode) {
        self.shared.open_mode.store(mode as u8, Ordering::SeqCst);
    }

    /// End the session: the workers return, `next_request` answers None.
    pub fn stop(&self) {
        self.shared.finish(None);
    }

    /// Wait for the workers, then close their descriptors.
    pub fn join(&self) {
        let threads = std::mem::take(
            &mut *self
                .workers
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        );
        for thread in threads {
            let _ = thread.join();
        }
        // Python's workers ended before this is called: nobody answers through these now.
        self.devices
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clear();
    }

    /// Why the session ended, if not by an unmount or `stop`.
    pub fn failure(&self) -> Option<String> {
        self.shared
            .failure
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }
}

struct Worker {
    shared: Arc<Shared>,
    device: Arc<File>,
    waiter: device::Waiter,
    buffer: Vec<u8>,
    data: Vec<u8>,
}

impl Worker {
    fn new(shared: Arc<Shared>, device: Arc<File>, request_buffer: usize) -> io::Result<Self> {
        let waiter = device::Waiter::new(&device, &shared.end)?;
        Ok(Worker {
            shared,
            device,
            waiter,
            buffer: vec![0; request_buffer],
            data: Vec::new(),
        })
    }

    fn run(mut self) {
        while !self.shared.ended.load(Ordering::SeqCst) {
            let size = match self.device.as_ref().read(&mut self.buffer) {
                Ok(size) => size,
                Err(error) => match error.raw_os_error() {
                    Some(libc::EAGAIN) => match self.waiter.wait() {
                        Ok(true) => continue,
                        Ok(false) => return,
                        Err(error) => {
                            return self
                                .shared
                                .finish(Some(format!("waiting on /dev/fuse: {error}")))
                        }
                    },
                    // Interrupted before it was read: nothing to answer.
                    Some(libc::ENOENT) | Some(libc::EINTR) => continue,
                    // Unmounted.
                    Some(libc::ENODEV) => return self.shared.finish(None),
                    _ => {
                        return self
                            .shared
                            .finish(Some(format!("reading /dev/fuse: {error}")))
                    }
                },
            };
            // A bug in answering (a panic, its message on stderr) must not
            // lose the request, whose caller would wait for good, nor the
            // worker: the request goes to Python, which answers it (again,
            // if a reply went out: the kernel then refuses the second).
            let answered = panic::catch_unwind(AssertUnwindSafe(|| self.answer(size)));
            if !answered.unwrap_or(false) {
                let request = Handed {
                    fd: self.device.as_raw_fd(),
                    message: self.buffer[..size].to_vec(),
                };
                self.shared.handed().push_back(request);
                self.shared.handed_ready.notify_one();
            }
        }
    }

    /// Answer the request in `buffer[..size]` natively; false if it is Python's.
    fn answer(&mut self, size: usize) -> bool {
        let Ok((header, request)) = abi::decode(&self.buffer[..size]) else {
            return false;
        };
        let (tables, reports) = (&self.shared.tables, &self.shared.reports);
        match request {
            // The kernel waits for no answer to these three: never handed on.
            Request::Interrupt => true,
            Request::Forget { count } => {
                if tables.forget(header.nodeid, count, Instant::now()) {
                    reports.forgotten(vec![header.nodeid]);
                }
                reports.answered(reports::FORGET);
                true
            }
            Request::BatchForget { pairs } => {
                let now = Instant::now();
                let gone = pairs
                    .into_iter()
                    .filter(|&(inode, count)| tables.forget(inode, count, now))
                    .map(|(inode, _)| inode)
                    .collect();
                reports.forgotten(gone);
                reports.answered(reports::BATCH_FORGET);
                true
            }
            Request::Lookup { name } => {
                let mut gone = Vec::new();
                let found = tables.lookup(header.nodeid, name, Instant::now(), &mut gone);
                reports.forgotten(gone);
                let Some(found) = found else { return false };
                let reply =
                    abi::entry_reply(header.unique, found.inode, &found.attr, found.timeout);
                // Interrupted: the kernel holds no reference.
                if self.send(&[&reply]).is_err() && tables.forget(found.inode, 1, Instant::now()) {
                    reports.forgotten(vec![found.inode]);
                }
                reports.answered(reports::LOOKUP);
                true
            }
            Request::Getattr => {
                let Some((attr, timeout)) = tables.getattr(header.nodeid) else {
                    return false;
                };
                let _ = self.send(&[&abi::attr_reply(header.unique, &attr, timeout)]);
                reports.answered(reports::GETATTR);
                true
            }
            Request::Open { flags } => self.open(header, flags),
            Request::Release { fh } => {
                if fh > THROUGH_HANDLE {
                    return false; // a staged file's
                }
                self.shared
                    .opens
                    .release(header.nodeid, fh == THROUGH_HANDLE);
                let _ = self.send(&[&abi::empty_reply(header.unique)]);
                reports.answered(reports::RELEASE);
                true
            }
            Request::Flush { fh } => {
                if !self.shared.writable {
                    let _ = self.send(&[&abi::error_reply(header.unique, libc::ENOSYS)]);
                    return true;
                }
                if fh > THROUGH_HANDLE {
                    return false; // a staged file's: its bytes may wait for the flush
                }
                let _ = self.send(&[&abi::empty_reply(header.unique)]);
                reports.answered(reports::FLUSH);
                true
            }
            Request::Readdirplus { fh, offset, size } => self.readdirplus(header, fh, offset, size),
            Request::Releasedir { fh } => {
                let mut gone = Vec::new();
                if !tables.release_listing(fh, Instant::now(), &mut gone) {
                    return false;
                }
                reports.forgotten(gone);
                let _ = self.send(&[&abi::empty_reply(header.unique)]);
                reports.answered(reports::RELEASEDIR);
                true
            }
            Request::Read { offset, size } => self.read(header, offset, size),
            // No file here has ioctls: answered as Python answers what it does not implement.
            Request::Ioctl => {
                let _ = self.send(&[&abi::error_reply(header.unique, libc::ENOSYS)]);
                true
            }
            Request::Other => false,
        }
    }

    /// An OPEN for reading of a version `Tables` holds, by the open mode;
    /// false if it is Python's (a write, a staged file, the mode, or a
    /// first passthrough open whose whole file is not named here).
    fn open(&mut self, header: abi::Header, flags: u32) -> bool {
        let flags = flags as libc::c_int;
        let writing = flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0;
        let (tables, opens) = (&self.shared.tables, &self.shared.opens);
        if writing || !tables.cacheable(header.nodeid) {
            return false;
        }
        let mode = OpenMode::from_u8(self.shared.open_mode.load(Ordering::SeqCst));
        let through = match mode {
            OpenMode::Python => return false,
            OpenMode::Through => true,
            // Passthrough given up while files are open in it: OPEN is
            // answered by the rules until they are all released, handing
            // over no new file. Without such files, the kernel is told
            // (ENOSYS) to open files without asking, or answered a cached open.
            OpenMode::Cached | OpenMode::NoOpen if !opens.passing_through() => {
                let reply = if mode == OpenMode::NoOpen {
                    abi::error_reply(header.unique, libc::ENOSYS)
                } else {
                    abi::open_reply(header.unique, CACHED_HANDLE, abi::FOPEN_KEEP_CACHE, 0)
                };
                let _ = self.send(&[&reply]);
                self.shared.reports.answered(reports::OPEN);
                return true;
            }
            OpenMode::Cached | OpenMode::NoOpen => false,
        };
        let opened = match opens.begin(header.nodeid, false, false) {
            Begin::BeingFound | Begin::Busy => return false,
            Begin::Decided(opened) => opened,
            Begin::Find => {
                let whole = through.then(|| tables.whole(header.nodeid)).flatten();
                match whole.map(|whole| (open_verified(&whole, 0), whole)) {
                    Some((Ok(file), whole)) => opens.finish(
                        header.nodeid,
                        Some((file.as_raw_fd(), Arc::clone(&whole.tier))),
                        false,
                    ),
                    // Python looks in the cache (a whole file made since).
                    _ if through => {
                        opens.abandon(header.nodeid);
                        return false;
                    }
                    _ => opens.finish(header.nodeid, None, false),
                }
            }
        };
        let reply = match &opened {
            Opened::Cached => {
                abi::open_reply(header.unique, CACHED_HANDLE, abi::FOPEN_KEEP_CACHE, 0)
            }
            Opened::Through(backing) => abi::open_reply(
                header.unique,
                THROUGH_HANDLE,
                abi::FOPEN_PASSTHROUGH,
                backing.id,
            ),
        };
        if self.send(&[&reply]).is_err() {
            // Interrupted: nothing was opened.
            opens.release(header.nodeid, matches!(opened, Opened::Through(_)));
            return true;
        }
        match opened {
            Opened::Through(backing) => self.shared.reports.opened(OpenReport {
                inode: header.nodeid,
                pid: header.pid,
                tier: backing.tier,
            }),
            Opened::Cached => self.shared.reports.answered(reports::OPEN),
        }
        true
    }

    /// As many entries of listing `fh` from index `offset` as fit in
    /// `size` bytes, each with its attributes; each entry sent (but `.` and
    /// `..`) is a reference the kernel holds. False if Python has the listing.
    fn readdirplus(&mut self, header: abi::Header, fh: u64, offset: u64, size: u32) -> bool {
        let (tables, reports) = (&self.shared.tables, &self.shared.reports);
        let Some(listing) = tables.listing(fh) else {
            return false;
        };
        let now = Instant::now();
        let (mut body, mut sent, mut gone) = (Vec::new(), Vec::new(), Vec::new());
        let first = usize::try_from(offset).unwrap_or(usize::MAX);
        for (index, entry) in listing.entries.iter().enumerate().skip(first) {
            if body.len() + abi::direntplus_size(entry.name.len()) > size as usize {
                break;
            }
            if !entry.is_dot() {
                let (inode, attr) = (entry.inode, entry.attr);
                tables.hold(
                    inode,
                    listing.directory,
                    &entry.name,
                    attr,
                    entry.cacheable,
                    now,
                    &mut gone,
                );
                sent.push(inode);
            }
            let timeout = tables.timeout(entry.cacheable);
            abi::pack_direntplus(
                &mut body,
                entry.inode,
                &entry.attr,
                timeout,
                &entry.name,
                index as u64 + 1,
            );
        }
        let reply = abi::reply_header(header.unique, body.len());
        if self.send(&[&reply, &body]).is_err() {
            // Interrupted: the kernel holds none of them.
            gone.extend(
                sent.into_iter()
                    .filter(|&inode| tables.forget(inode, 1, now)),
            );
        }
        reports.forgotten(gone);
        reports.answered(reports::READDIRPLUS);
        true
    }

    /// A READ from the cache files `Tables` names; false (nothing sent) if
    /// one of them is not the file verified any more.
    fn read(&mut self, header: abi::Header, offset: u64, size: u32) -> bool {
        let started = Instant::now();
        let Some(pieces) = self.shared.tables.read_plan(header.nodeid, offset, size) else {
            return false;
        };
        let total: usize = pieces.iter().map(|piece| piece.length).sum();
        // Room to align the start, and to read the last piece to a whole block.
        let room = total + 2 * DIRECT_ALIGNMENT;
        if self.data.len() < room {
            self.data.resize(room, 0);
        }
        let start = self
            .data
            .as_ptr()
            .align_offset(DIRECT_ALIGNMENT)
            .min(DIRECT_ALIGNMENT);
        let mut buffered = Vec::new();
        let mut at = start;
        for piece in &pieces {
            let address = self.data.as_ptr() as usize + at;
            let aligned =
                piece.offset % DIRECT_ALIGNMENT as u64 == 0 && address % DIRECT_ALIGNMENT == 0;
            match read_piece(piece, &mut self.data[at..], aligned) {
                Ok(Some(file)) => buffered.push((piece, file)),
                Ok(None) => {}
                Err(_) => return false,
            }
            at += piece.length;
        }
        let reply_header = abi::reply_header(header.unique, total);
        let _ = self.send(&[&reply_header, &self.data[start..start + total]]);
        for (piece, file) in buffered {
            device::drop_pages(&file, piece.offset, piece.length);
        }
        let mut served: Vec<(Arc<str>, u64)> = Vec::new();
        for piece in &pieces {
            match served.iter_mut().find(|(tier, _)| *tier == piece.file.tier) {
                Some((_, bytes)) => *bytes += piece.length as u64,
                None => served.push((Arc::clone(&piece.file.tier), piece.length as u64)),
            }
        }
        self.shared.reports.read(ReadReport {
            inode: header.nodeid,
            offset,
            size: total as u64,
            pid: header.pid,
            served,
            seconds: started.elapsed().as_secs_f64(),
        });
        true
    }

    /// Write one answer with one `writev`. An error means the request is
    /// gone (interrupted, ENOENT) or the connection ended: either way
    /// nothing more is owed to it.
    fn send(&self, parts: &[&[u8]]) -> io::Result<()> {
        let slices: Vec<IoSlice<'_>> = parts.iter().map(|part| IoSlice::new(part)).collect();
        self.device.as_ref().write_vectored(&slices).map(|_| ())
    }
}

/// `block_file`'s file, opened with `flags`, if it is still the one verified.
fn open_verified(block_file: &BlockFile, flags: libc::c_int) -> io::Result<File> {
    let file = File::options()
        .read(true)
        .custom_flags(flags)
        .open(&block_file.path)?;
    let status = file.metadata()?;
    let identity = FileIdentity {
        dev: status.dev(),
        ino: status.ino(),
        ctime_ns: status.ctime() * 1_000_000_000 + status.ctime_nsec(),
    };
    if identity != block_file.identity {
        return Err(io::Error::other(
            "the cache file changed since it was verified",
        ));
    }
    Ok(file)
}

/// Read `piece` to the start of `into` from its file, if that file is
/// still the one verified: past the page cache where the piece and `into`
/// are `aligned` and the filesystem takes O_DIRECT (then None: no pages
/// to drop), else through it (then the file, whose pages to drop). `into`
/// has room to read the piece to a whole `DIRECT_ALIGNMENT`.
fn read_piece(piece: &Piece, into: &mut [u8], aligned: bool) -> io::Result<Option<File>> {
    if aligned {
        match open_verified(&piece.file, libc::O_DIRECT) {
            Ok(file) => {
                let padded = piece.length.next_multiple_of(DIRECT_ALIGNMENT);
                let read = file.read_at(&mut into[..padded], piece.offset)?;
                if read < piece.length {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                return Ok(None);
            }
            // A filesystem without O_DIRECT (tmpfs): through the page cache.
            Err(error) if error.raw_os_error() == Some(libc::EINVAL) => {}
            Err(error) => return Err(error),
        }
    }
    let file = open_verified(&piece.file, 0)?;
    file.read_exact_at(&mut into[..piece.length], piece.offset)?;
    Ok(Some(file))
}

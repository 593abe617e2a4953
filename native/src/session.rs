//! One mount's FUSE session, served on native threads.
//!
//! Each worker reads the kernel's requests from a descriptor of its own (a
//! clone of the connection) and answers what `Tables` knows: LOOKUP of a
//! fresh name, GETATTR of a version, READ of blocks in verified cache
//! files, the FORGETs (counted here) and INTERRUPT (a request is
//! interrupted by answering it). Every other request is handed to Python
//! whole (`next_request`), with the descriptor its answer goes back
//! through, one request a call: a directory not listed yet, an open, a
//! write, a block no file holds.
//!
//! A request is answered once: natively, or by Python. A native answer
//! that fails half way (a cache file gone or changed, a short read) has
//! sent nothing yet, so the request goes to Python as it came.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, IoSlice, Read, Write};
use std::os::fd::{OwnedFd, RawFd};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::abi::{self, Request};
use crate::device;
use crate::reports::{self, ReadReport, Reports};
use crate::tables::{FileIdentity, Piece, Tables};

/// A request for Python: the descriptor it was read from, and its bytes.
pub struct Handed {
    pub fd: RawFd,
    pub message: Vec<u8>,
}

struct Shared {
    tables: Arc<Tables>,
    reports: Arc<Reports>,
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
}

impl Session {
    /// Serve the connection of `session_fd` on `workers` threads, each
    /// reading requests into a buffer of `request_buffer` bytes, telling
    /// `reports` what they did.
    pub fn start(
        session_fd: RawFd,
        tables: Arc<Tables>,
        reports: Arc<Reports>,
        workers: usize,
        request_buffer: usize,
    ) -> io::Result<Self> {
        let devices = (0..workers)
            .map(|_| device::clone_connection(session_fd))
            .collect::<io::Result<Vec<File>>>()?;
        let shared = Arc::new(Shared {
            tables,
            reports,
            handed: Mutex::new(VecDeque::new()),
            handed_ready: Condvar::new(),
            ended: AtomicBool::new(false),
            end: device::event()?,
            failure: Mutex::new(None),
        });
        let threads = devices
            .into_iter()
            .enumerate()
            .map(|(number, device)| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("cachefsd-native-{number}"))
                    .spawn(move || Worker::new(shared, device, request_buffer).run())
            })
            .collect::<io::Result<Vec<_>>>()?;
        Ok(Session {
            shared,
            workers: Mutex::new(threads),
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

    /// End the session: the workers return, `next_request` answers None.
    pub fn stop(&self) {
        self.shared.finish(None);
    }

    /// Wait for the workers; their descriptors close with them.
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
    device: File,
    buffer: Vec<u8>,
    data: Vec<u8>,
}

impl Worker {
    fn new(shared: Arc<Shared>, device: File, request_buffer: usize) -> Self {
        Worker {
            shared,
            device,
            buffer: vec![0; request_buffer],
            data: Vec::new(),
        }
    }

    fn run(mut self) {
        use std::os::fd::AsRawFd;
        while !self.shared.ended.load(Ordering::SeqCst) {
            let size = match (&self.device).read(&mut self.buffer) {
                Ok(size) => size,
                Err(error) => match error.raw_os_error() {
                    Some(libc::EAGAIN) => match device::wait(&self.device, &self.shared.end) {
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
            if !self.answer(size) {
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
            Request::Read { offset, size } => self.read(header, offset, size),
            // No file here has ioctls: answered as Python answers what it does not implement.
            Request::Ioctl => {
                let _ = self.send(&[&abi::error_reply(header.unique, libc::ENOSYS)]);
                true
            }
            Request::Other => false,
        }
    }

    /// A READ from the cache files `Tables` names; false (nothing sent) if
    /// one of them is not the file verified any more.
    fn read(&mut self, header: abi::Header, offset: u64, size: u32) -> bool {
        let started = Instant::now();
        let Some(pieces) = self.shared.tables.read_plan(header.nodeid, offset, size) else {
            return false;
        };
        let total: usize = pieces.iter().map(|piece| piece.length).sum();
        self.data.resize(total, 0);
        let mut opened = Vec::with_capacity(pieces.len());
        let mut at = 0;
        for piece in &pieces {
            match read_piece(piece, &mut self.data[at..at + piece.length]) {
                Ok(file) => opened.push(file),
                Err(_) => return false,
            }
            at += piece.length;
        }
        let reply_header = abi::data_reply_header(header.unique, total);
        let _ = self.send(&[&reply_header, &self.data[..total]]);
        let mut served: Vec<(Arc<str>, u64)> = Vec::new();
        for (piece, file) in pieces.iter().zip(&opened) {
            device::drop_pages(file, piece.offset, piece.length);
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
        (&self.device).write_vectored(&slices).map(|_| ())
    }
}

/// Read `piece` into `into` from its file, if that file is still the one verified.
fn read_piece(piece: &Piece, into: &mut [u8]) -> io::Result<File> {
    let file = File::open(&piece.file.path)?;
    let status = file.metadata()?;
    let identity = FileIdentity {
        dev: status.dev(),
        ino: status.ino(),
        ctime_ns: status.ctime() * 1_000_000_000 + status.ctime_nsec(),
    };
    if identity != piece.file.identity {
        return Err(io::Error::other(
            "the cache file changed since it was verified",
        ));
    }
    file.read_exact_at(into, piece.offset)?;
    Ok(file)
}

//! The kernel's requests as the native plane decodes them: any bytes read
//! from /dev/fuse decode to a request or to `Malformed` (handed to Python),
//! never a panic, and a decoded request never claims more bytes than came.

#![no_main]

use cachefsd_native::abi::{decode, Request};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|message: &[u8]| {
    if let Ok((_, request)) = decode(message) {
        match request {
            Request::Lookup { name } => assert!(name.len() < message.len() && !name.contains(&0)),
            Request::BatchForget { pairs } => assert!(pairs.len() * 16 <= message.len()),
            _ => {}
        }
    }
});

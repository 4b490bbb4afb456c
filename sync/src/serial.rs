//! A serial queue: jobs run one at a time, in the order they were pushed,
//! by a serving thread or by a thread that takes them over while it waits
//! for one of them.
//!
//! Chorus queues each communicator's hook events on one of these: its hook
//! thread [`serve`](SerialQueue::serve)s the queue, and a caller blocked on
//! an op [`help`](SerialQueue::help)s, running the queued events itself
//! until its op's have run, instead of waiting for the hook thread to wake
//! (two context switches in a row).
//!
//! Costs: [`push`](SerialQueue::push) is O(1) under one lock plus a
//! condition-variable notify; memory is O(jobs queued).
//!
//! # Invariants
//!
//! | tag | rule |
//! |-----|------|
//! | SQ-1 | jobs run one at a time, in push order: a job is popped and run only by the holder of the runner lock. |
//! | SQ-2 | every job pushed before [`close`](SerialQueue::close) runs exactly once, if a thread serves the queue: `serve` returns only once it is closed and empty. |
//! | SQ-3 | `help` never blocks on the runner: if another thread holds it, `help` returns at once (that thread runs the jobs). |
//!
//! The loom model in `tests/loom_serial.rs` checks these over serve, push,
//! help and close interleavings.

use std::collections::VecDeque;

use crate::sync::{lock, Condvar, Mutex};

/// Jobs run one at a time in push order (SQ-1); see the module docs.
pub struct SerialQueue<J> {
    state: Mutex<State<J>>,
    more: Condvar,
    /// Held while popping and running jobs.
    runner: Mutex<()>,
}

struct State<J> {
    jobs: VecDeque<J>,
    closed: bool,
}

impl<J: FnOnce()> Default for SerialQueue<J> {
    fn default() -> Self {
        SerialQueue::new()
    }
}

impl<J: FnOnce()> SerialQueue<J> {
    /// An empty, open queue.
    pub fn new() -> Self {
        SerialQueue {
            state: Mutex::new(State {
                jobs: VecDeque::new(),
                closed: false,
            }),
            more: Condvar::new(),
            runner: Mutex::new(()),
        }
    }

    /// Queue `job` and wake the serving thread.
    pub fn push(&self, job: J) {
        lock(&self.state).jobs.push_back(job);
        self.more.notify_one();
    }

    /// No more jobs will be pushed: `serve` returns once the queue is
    /// empty.
    pub fn close(&self) {
        lock(&self.state).closed = true;
        self.more.notify_one();
    }

    fn pop(&self) -> Option<J> {
        lock(&self.state).jobs.pop_front()
    }

    /// Run jobs as they come, until the queue is closed and empty (SQ-2).
    pub fn serve(&self) {
        loop {
            {
                let mut st = lock(&self.state);
                while st.jobs.is_empty() && !st.closed {
                    st = self.more.wait(st).unwrap_or_else(|e| e.into_inner());
                }
                if st.jobs.is_empty() {
                    return;
                }
            }
            let _runner = lock(&self.runner);
            while let Some(job) = self.pop() {
                job();
            }
        }
    }

    /// Run queued jobs here, in order, until `done()` holds or the queue is
    /// empty, unless another thread is running jobs now (SQ-3). Returns
    /// whether this thread held the runner.
    pub fn help(&self, done: impl Fn() -> bool) -> bool {
        let _runner = match self.runner.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        while !done() {
            let Some(job) = self.pop() else { break };
            job();
        }
        true
    }
}

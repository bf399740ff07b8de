//! One registration of the agent, from the server's answer until `stop` or until the server
//! no longer knows the node. A loop owns all state and handles one event at a time: a report
//! from a job's thread, a job's end, or the reply to a request. One heartbeat is always
//! waiting at the server (`wait_ms`: it answers when there is an assignment or a fence for
//! this node, or after the interval); a report that should not wait for it (a start, an end, a
//! checkpoint) goes at once in a second, immediate beat.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBackoff};

use super::client::{CallError, Client, Files, backoff};
use super::{AgentConfig, AgentMetrics, job};
use wire::JobId;
use wire::agent::{Heartbeat, HeartbeatResponse, RegisterResponse, Report};

/// A job's attempt: (job id, attempt).
pub(super) type Key = (JobId, u32);

/// How often the loop looks at `stop` while nothing happens.
const TICK: Duration = Duration::from_millis(50);
/// The longest a heartbeat waits at the server.
const MAX_WAIT: Duration = Duration::from_secs(20);
/// How long an ended attempt is remembered, so that a reply offering it again, however late,
/// does not start it twice (a reply is at most one HTTP timeout old; this is many).
const REMEMBER_ENDED: Duration = Duration::from_secs(600);

/// What the loop hears.
pub(super) enum Event {
    Report(Report),
    /// The job's thread sent its last report and is ending.
    Ended(Key),
    Reply {
        /// The waiting heartbeat (rather than an immediate one).
        waiting: bool,
        sent: Vec<Report>,
        result: Result<HeartbeatResponse, CallError>,
    },
}

/// Where a job's threads send their reports.
#[derive(Clone)]
pub(super) struct Outbox(Sender<Event>);

impl Outbox {
    pub(super) fn report(&self, r: Report) {
        // The loop is gone only once the agent stopped; nobody is left to tell.
        let _ = self.0.send(Event::Report(r));
    }

    pub(super) fn ended(&self, key: Key) {
        let _ = self.0.send(Event::Ended(key));
    }
}

pub(super) enum Ended {
    /// `stop` was set.
    Stopped,
    /// The server declared the node lost or does not know it: every rank was stopped.
    Lost,
}

enum Run {
    Running {
        cancel: Arc<AtomicBool>,
        thread: JoinHandle<()>,
        /// The server said the attempt is over; the ranks stop after their current step.
        stopping: bool,
    },
    Ended(Instant),
}

pub(super) struct Registration<'a> {
    cfg: &'a AgentConfig,
    client: &'a Client,
    metrics: &'a AgentMetrics,
    node: RegisterResponse,
    tx: Sender<Event>,
    rx: Receiver<Event>,
    /// Every attempt this registration started: running ones, and ended ones for a while.
    attempts: HashMap<Key, Run>,
    /// Attempts the last reply offered that ran here already: listed as running, so the server
    /// stops offering them (and a waiting heartbeat does not return at once for them).
    offered_again: Vec<Key>,
    unsent: Vec<Report>,
    waiting: bool,
    immediate: bool,
    /// After a failed request: when the next may go, and the delays still to come.
    retry_at: Option<Instant>,
    backoff: Option<ExponentialBackoff>,
    /// An agent of one job (`AgentConfig::one_job`) whose attempt ended: it sends what is
    /// left to send, then stops.
    leaving: bool,
}

impl<'a> Registration<'a> {
    pub(super) fn new(
        cfg: &'a AgentConfig,
        client: &'a Client,
        metrics: &'a AgentMetrics,
        node: RegisterResponse,
    ) -> Registration<'a> {
        let (tx, rx) = mpsc::channel();
        Registration {
            cfg,
            client,
            metrics,
            node,
            tx,
            rx,
            attempts: HashMap::new(),
            offered_again: Vec::new(),
            unsent: Vec::new(),
            waiting: false,
            immediate: false,
            retry_at: None,
            backoff: None,
            leaving: false,
        }
    }

    pub(super) fn run(mut self, stop: &AtomicBool) -> Ended {
        let ended = loop {
            if stop.load(Ordering::Relaxed) {
                break Ended::Stopped;
            }
            if self.leaving && self.unsent.is_empty() && !self.waiting && !self.immediate {
                break Ended::Stopped;
            }
            let now = Instant::now();
            let may_send = self.retry_at.is_none_or(|t| now >= t);
            if may_send && !self.waiting && !self.leaving {
                self.send(true);
            }
            let urgent = self.unsent.iter().any(Report::is_urgent);
            let last = self.leaving && !self.unsent.is_empty();
            if may_send && !self.immediate && (urgent || last) {
                self.send(false);
            }
            let tick = self
                .retry_at
                .map_or(TICK, |t| t.saturating_duration_since(now).min(TICK));
            match self.rx.recv_timeout(tick) {
                Ok(Event::Report(r)) => self.unsent.push(r),
                Ok(Event::Ended(key)) => self.job_ended(key),
                Ok(Event::Reply {
                    waiting,
                    sent,
                    result,
                }) => {
                    *(if waiting {
                        &mut self.waiting
                    } else {
                        &mut self.immediate
                    }) = false;
                    match result {
                        Ok(reply) => self.answered(reply, &sent),
                        Err(CallError::Gone) => break Ended::Lost,
                        Err(e) => self.failed(sent, &e),
                    }
                }
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {}
            }
        };
        self.stop_all(matches!(ended, Ended::Lost));
        ended
    }

    /// Sends a heartbeat with every unsent report on a thread of its own; `waiting`: the one
    /// that waits at the server for work.
    fn send(&mut self, waiting: bool) {
        let mut running: Vec<Key> = self
            .attempts
            .iter()
            .filter(|(_, run)| {
                matches!(
                    run,
                    Run::Running {
                        stopping: false,
                        ..
                    }
                )
            })
            .map(|(k, _)| k.clone())
            .collect();
        running.extend(self.offered_again.iter().cloned());
        let interval = Duration::from_millis(self.node.heartbeat_interval_ms).min(MAX_WAIT);
        let beat = Heartbeat {
            reports: std::mem::take(&mut self.unsent),
            running,
            wait_ms: if waiting {
                interval.as_millis() as u64
            } else {
                0
            },
        };
        let (client, tx) = (self.client.clone(), self.tx.clone());
        let (node, token) = (self.node.node_id.clone(), self.node.agent_token.clone());
        std::thread::spawn(move || {
            let result = client.beat(&node, &token, &beat);
            let _ = tx.send(Event::Reply {
                waiting,
                sent: beat.reports,
                result,
            });
        });
        if waiting {
            self.waiting = true;
        } else {
            self.immediate = true;
        }
    }

    fn answered(&mut self, reply: HeartbeatResponse, sent: &[Report]) {
        self.retry_at = None;
        self.backoff = None;
        self.metrics.series.heartbeats_total.inc();
        let steps = sent
            .iter()
            .filter(|r| matches!(r, Report::Step { .. }))
            .count();
        self.metrics.series.steps_total.inc_by(steps as u64);
        for r in &reply.refused {
            if let Some(report) = sent.get(r.index) {
                let (job, attempt) = report.key();
                eprintln!(
                    "agent {}: the server refused a report of job {job} attempt {attempt}: {}",
                    self.cfg.name,
                    r.reason.as_str()
                );
            }
        }
        self.offered_again.clear();
        for a in reply.assignments {
            let key = (a.job_id.clone(), a.attempt);
            if self.attempts.contains_key(&key) {
                self.offered_again.push(key);
                continue;
            }
            let cancel = Arc::new(AtomicBool::new(false));
            let files = Files::new(
                &self.cfg.server,
                &self.node.node_id,
                &self.node.agent_token,
                &a.job_id,
                a.attempt,
            );
            let thread = job::start(a, self.cfg, files, cancel.clone(), Outbox(self.tx.clone()));
            let run = Run::Running {
                cancel,
                thread,
                stopping: false,
            };
            self.attempts.insert(key, run);
        }
        for key in reply.cancel {
            if let Some(Run::Running {
                cancel, stopping, ..
            }) = self.attempts.get_mut(&key)
                && !*stopping
            {
                cancel.store(true, Ordering::Relaxed);
                *stopping = true;
                self.metrics.series.attempts_fenced_total.inc();
            }
        }
        self.count_running();
    }

    /// The request failed: its reports go with the next, which waits for the backoff's delay.
    fn failed(&mut self, mut sent: Vec<Report>, e: &CallError) {
        self.metrics.series.heartbeat_failures_total.inc();
        sent.append(&mut self.unsent);
        self.unsent = sent;
        let delay = self
            .backoff
            .get_or_insert_with(|| backoff().build())
            .next()
            .unwrap_or(TICK);
        self.retry_at = Some(Instant::now() + delay);
        eprintln!(
            "agent {}: heartbeat failed ({e}); trying again in {delay:.1?}",
            self.cfg.name
        );
    }

    fn job_ended(&mut self, key: Key) {
        let now = Instant::now();
        if let Some(run) = self.attempts.get_mut(&key)
            && let Run::Running { thread, .. } = std::mem::replace(run, Run::Ended(now))
        {
            // It sent its last report; a panic there has been printed already.
            let _ = thread.join();
            self.leaving = self.cfg.one_job;
        }
        self.attempts.retain(|_, run| match run {
            Run::Ended(at) => now.duration_since(*at) < REMEMBER_ENDED,
            Run::Running { .. } => true,
        });
        self.count_running();
    }

    fn count_running(&self) {
        let n = self
            .attempts
            .values()
            .filter(|run| matches!(run, Run::Running { .. }))
            .count();
        self.metrics.series.jobs_running.set(n as i64);
    }

    /// Tells every running attempt to stop; when the node was lost, waits until they have, so
    /// its devices are free before it registers again.
    fn stop_all(self, wait: bool) {
        let mut threads = Vec::new();
        for run in self.attempts.into_values() {
            if let Run::Running { cancel, thread, .. } = run {
                cancel.store(true, Ordering::Relaxed);
                if wait {
                    self.metrics.series.attempts_fenced_total.inc();
                }
                threads.push(thread);
            }
        }
        if wait {
            for t in threads {
                let _ = t.join();
            }
            self.metrics.series.jobs_running.set(0);
        }
    }
}

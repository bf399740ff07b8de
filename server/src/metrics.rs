//! Prometheus series, one typed struct per scope. Each field's doc comment is its HELP text and
//! its name, after the `zerotrain_` prefix, is the series name; units are base units. Training
//! series carry a `job` label (and `rank` where a rank reports them) and are removed a while
//! after the job ends.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramVec, IntCounterVec, IntGaugeVec, Registry,
    TextEncoder,
};
use scheduler::memory::{Breakdown, Category};
use scheduler::spec::Architecture;
use wire::Op;
use wire::agent::RefusalReason;

use crate::domain::{JobId, JobState, StepRecord};

wire::metrics! {
    /// The server's own series.
    pub struct ServerMetrics("zerotrain_") {
        /// Jobs in each state.
        pub jobs: IntGaugeVec, labels = ["state"];
        /// Seconds a job waited in the queue before it was scheduled.
        pub queue_wait_seconds: Histogram,
            buckets = vec![0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 14400.0, 86400.0];
        /// Seconds one scheduling pass took.
        pub scheduling_pass_duration_seconds: Histogram,
            buckets = prometheus::exponential_buckets(0.0005, 2.0, 16).expect("valid buckets");
        /// HTTP requests answered, by matched route, method and status.
        pub http_requests_total: IntCounterVec, labels = ["route", "method", "status"];
        /// Seconds to answer an HTTP request (to its response headers), by matched route.
        pub http_request_duration_seconds: HistogramVec, labels = ["route", "method"],
            buckets = prometheus::exponential_buckets(0.0001, 2.0, 16).expect("valid buckets");
        /// Agents' heartbeats waiting at the server for an assignment or a fence now.
        pub agent_heartbeats_waiting: Gauge;
        /// Reports from agents the server did not apply, by reason.
        pub agent_reports_refused_total: IntCounterVec, labels = ["reason"];
    }
}

wire::metrics! {
    /// Series of running jobs, as their agents report them.
    pub struct TrainingMetrics("zerotrain_") {
        /// Peak bytes a rank holds, by category: measured by the trainer or predicted by the memory model; on a GPU also the device's used memory as its driver reports it (category total, source device).
        pub training_memory_bytes: IntGaugeVec, labels = ["job", "rank", "category", "source"];
        /// 1 for each job with steps, naming its model (type and size, as the console shows it) and family: join on `job` to label its other series.
        pub training_job_info: IntGaugeVec, labels = ["job", "model", "family"];
        /// Training loss of the job's last step.
        pub training_loss: GaugeVec, labels = ["job"];
        /// Mean validation loss of the job's last step after which validation ran.
        pub training_validation_loss: GaugeVec, labels = ["job"];
        /// Loss scale after the job's last step (1 without fp16 loss scaling).
        pub training_loss_scale: GaugeVec, labels = ["job"];
        /// Tokens the job has trained on.
        pub training_tokens_total: IntCounterVec, labels = ["job"];
        /// Steps skipped because the gradients overflowed.
        pub training_skipped_steps_total: IntCounterVec, labels = ["job"];
        /// Bytes a rank sent, by collective.
        pub training_comm_bytes_total: IntCounterVec, labels = ["job", "rank", "op"];
        /// Seconds one optimizer step took.
        pub training_step_duration_seconds: HistogramVec, labels = ["job"],
            buckets = prometheus::exponential_buckets(0.01, 2.0, 14).expect("valid buckets");
    }
}

/// Every series this server exports.
pub struct Metrics {
    registry: Registry,
    pub server: ServerMetrics,
    pub training: TrainingMetrics,
    /// Label sets each job's per-rank series were created with, to remove them all.
    job_series: Mutex<HashMap<String, JobSeries>>,
    /// Jobs that ended, and when, whose series go once the grace period has passed.
    ended: Mutex<Vec<(Instant, String)>>,
}

#[derive(Default)]
struct JobSeries {
    /// The labels of its `training_job_info`.
    info: Option<(String, &'static str)>,
    memory: BTreeSet<(String, &'static str, &'static str)>,
    comm: BTreeSet<(String, String)>,
}

impl Default for Metrics {
    fn default() -> Self {
        let registry = Registry::new();
        let server = ServerMetrics::new(&registry);
        // Every reason is exported from the start, at 0.
        for &reason in RefusalReason::ALL {
            server
                .agent_reports_refused_total
                .with_label_values(&[reason.as_str()]);
        }
        Metrics {
            server,
            training: TrainingMetrics::new(&registry),
            registry,
            job_series: Mutex::default(),
            ended: Mutex::default(),
        }
    }
}

impl Metrics {
    /// The Prometheus text exposition of every series.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding cannot fail");
        String::from_utf8(out).expect("the text format is UTF-8")
    }

    /// Counts `n` reports refused for `reason`.
    pub fn refused(&self, reason: RefusalReason, n: usize) {
        self.server
            .agent_reports_refused_total
            .with_label_values(&[reason.as_str()])
            .inc_by(n as u64);
    }

    pub fn set_job_counts(&self, counts: &[(JobState, i64)]) {
        for &state in JobState::ALL {
            let n = counts.iter().find(|(s, _)| *s == state).map_or(0, |c| c.1);
            self.server.jobs.with_label_values(&[state.as_str()]).set(n);
        }
    }

    /// A step of `job`, whose model is `model`.
    pub fn observe_step(&self, job: &JobId, model: &Architecture, step: &StepRecord) {
        let job = job.as_str();
        let t = &self.training;
        let mut series = self.job_series.lock().expect("metrics lock");
        let series = series.entry(job.to_string()).or_default();
        if series.info.is_none() {
            let family = model.model().map_or("none", |m| m.summary().family);
            let label = model.label();
            t.training_job_info
                .with_label_values(&[job, &label, family])
                .set(1);
            series.info = Some((label, family));
        }
        t.training_loss.with_label_values(&[job]).set(step.loss);
        // Only some steps validate: the gauge holds the last one that did.
        if let Some(v) = step.validation_loss {
            t.training_validation_loss.with_label_values(&[job]).set(v);
        }
        t.training_loss_scale
            .with_label_values(&[job])
            .set(f64::from(step.loss_scale));
        let tokens = (step.tokens_per_second * step.step_seconds).round();
        if tokens.is_finite() && tokens > 0.0 {
            t.training_tokens_total
                .with_label_values(&[job])
                .inc_by(tokens as u64);
        }
        let skipped = t.training_skipped_steps_total.with_label_values(&[job]);
        if step.skipped {
            skipped.inc();
        }
        t.training_step_duration_seconds
            .with_label_values(&[job])
            .observe(step.step_seconds);
    }

    /// A rank's measured and predicted bytes, and on a GPU the driver's figure for the whole
    /// device (`category="total"`, `source="device"`); `comm_bytes_sent` are totals since the
    /// rank started, so the counters advance by what is new.
    pub fn observe_memory(
        &self,
        job: &JobId,
        rank: u32,
        measured: &Breakdown,
        predicted: &Breakdown,
        device_used: Option<u64>,
        comm_bytes_sent: &std::collections::BTreeMap<Op, u64>,
    ) {
        let job = job.as_str();
        let rank = rank.to_string();
        let mut series = self.job_series.lock().expect("metrics lock");
        let series = series.entry(job.to_string()).or_default();
        for (source, bytes) in [("measured", measured), ("predicted", predicted)] {
            for &c in Category::ALL {
                let value = i64::try_from(bytes.get(c)).unwrap_or(i64::MAX);
                self.training
                    .training_memory_bytes
                    .with_label_values(&[job, &rank, c.name(), source])
                    .set(value);
                series.memory.insert((rank.clone(), c.name(), source));
            }
        }
        if let Some(used) = device_used {
            self.training
                .training_memory_bytes
                .with_label_values(&[job, &rank, "total", "device"])
                .set(i64::try_from(used).unwrap_or(i64::MAX));
            series.memory.insert((rank.clone(), "total", "device"));
        }
        for (op, &total) in comm_bytes_sent {
            let counter = self.training.training_comm_bytes_total.with_label_values(&[
                job,
                &rank,
                op.as_str(),
            ]);
            counter.inc_by(total.saturating_sub(counter.get()));
            series.comm.insert((rank.clone(), op.as_str().to_string()));
        }
    }

    /// Marks `job` ended: its series go after `ttl` (see `expire`).
    pub fn job_ended(&self, job: &JobId) {
        self.ended
            .lock()
            .expect("metrics lock")
            .push((Instant::now(), job.to_string()));
    }

    /// Removes the series of jobs that ended more than `ttl` ago.
    pub fn expire(&self, ttl: Duration) {
        let due: Vec<String> = {
            let mut ended = self.ended.lock().expect("metrics lock");
            let (due, keep) = ended.drain(..).partition(|(at, _)| at.elapsed() >= ttl);
            *ended = keep;
            due.into_iter().map(|(_, job)| job).collect()
        };
        for job in due {
            self.remove_job(&job);
        }
    }

    fn remove_job(&self, job: &str) {
        let t = &self.training;
        // Removing a series that was never created is not an error worth reporting.
        let _ = t.training_loss.remove_label_values(&[job]);
        let _ = t.training_validation_loss.remove_label_values(&[job]);
        let _ = t.training_loss_scale.remove_label_values(&[job]);
        let _ = t.training_tokens_total.remove_label_values(&[job]);
        let _ = t.training_skipped_steps_total.remove_label_values(&[job]);
        let _ = t.training_step_duration_seconds.remove_label_values(&[job]);
        let series = self
            .job_series
            .lock()
            .expect("metrics lock")
            .remove(job)
            .unwrap_or_default();
        if let Some((model, family)) = &series.info {
            let _ = t
                .training_job_info
                .remove_label_values(&[job, model, family]);
        }
        for (rank, category, source) in &series.memory {
            let _ = t
                .training_memory_bytes
                .remove_label_values(&[job, rank, category, source]);
        }
        for (rank, op) in &series.comm {
            let _ = t
                .training_comm_bytes_total
                .remove_label_values(&[job, rank, op]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(skipped: bool) -> StepRecord {
        StepRecord {
            attempt: 1,
            step: 1,
            loss: 3.5,
            loss_scale: 1024.0,
            tokens_per_second: 1000.0,
            skipped,
            step_seconds: 0.5,
            at: 0,
            validation_loss: None,
        }
    }

    fn llama_tiny() -> Architecture {
        Architecture::Llama(scheduler::model::LlamaPreset::Tiny.shape())
    }

    #[test]
    fn series_are_named_with_the_prefix_and_help_from_the_doc_comment() {
        let m = Metrics::default();
        m.observe_step(&"j1".into(), &llama_tiny(), &step(true));
        let text = m.render();
        assert!(
            text.contains("# HELP zerotrain_training_loss Training loss of the job's last step."),
            "{text}"
        );
        assert!(text.contains("zerotrain_training_tokens_total{job=\"j1\"} 500"));
        assert!(text.contains("zerotrain_training_skipped_steps_total{job=\"j1\"} 1"));
        assert!(
            text.contains(
                "zerotrain_training_job_info{family=\"llama\",job=\"j1\",model=\"llama 158.0K\"} 1"
            ),
            "{text}"
        );
    }

    #[test]
    fn a_jobs_series_go_once_it_has_ended_and_the_grace_period_passed() {
        let m = Metrics::default();
        m.observe_step(&"j1".into(), &llama_tiny(), &step(false));
        m.observe_step(&"j2".into(), &llama_tiny(), &step(false));
        let bytes = Breakdown {
            params: 10,
            ..Breakdown::default()
        };
        m.observe_memory(
            &"j1".into(),
            0,
            &bytes,
            &bytes,
            Some(1 << 30),
            &Default::default(),
        );
        m.job_ended(&"j1".into());
        m.expire(Duration::from_secs(3600));
        assert!(m.render().contains("job=\"j1\""));
        m.expire(Duration::ZERO);
        let text = m.render();
        assert!(!text.contains("job=\"j1\""), "{text}");
        assert!(text.contains("job=\"j2\""));
    }

    #[test]
    fn the_validation_loss_gauge_keeps_the_last_validated_step_and_goes_with_the_job() {
        let m = Metrics::default();
        let series = "zerotrain_training_validation_loss{job=\"j1\"}";
        m.observe_step(&"j1".into(), &llama_tiny(), &step(false));
        assert!(!m.render().contains(series), "no step validated yet");
        let validated = StepRecord {
            validation_loss: Some(3.25),
            ..step(false)
        };
        m.observe_step(&"j1".into(), &llama_tiny(), &validated);
        m.observe_step(&"j1".into(), &llama_tiny(), &step(false));
        let text = m.render();
        assert!(text.contains(&format!("{series} 3.25")), "{text}");
        m.job_ended(&"j1".into());
        m.expire(Duration::ZERO);
        assert!(!m.render().contains(series));
    }

    #[test]
    fn comm_counters_advance_by_what_is_new() {
        let m = Metrics::default();
        let b = Breakdown::default();
        let mut sent = std::collections::BTreeMap::new();
        let op = Op::AllGather;
        sent.insert(op, 100);
        m.observe_memory(&"j".into(), 1, &b, &b, None, &sent);
        sent.insert(op, 250);
        m.observe_memory(&"j".into(), 1, &b, &b, None, &sent);
        let c = m
            .training
            .training_comm_bytes_total
            .with_label_values(&["j", "1", "all_gather"]);
        assert_eq!(c.get(), 250);
    }
}

//! Stable failure codes: the only words a failed job carries, so they may appear in metrics and
//! logs. Which are worth retrying is decided here and nowhere else.

use crate::jobs::arguments::invalid;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureCode {
    InvalidRequest,
    IntegrityViolation,
    TargetRejected,
    TargetUnavailable,
    UnexpectedFailure,
    /// Set by a claim that finds an expired lease with no attempts left; callers cannot report it.
    LeaseExpired,
}

impl FailureCode {
    pub const ALL: [FailureCode; 6] = [
        FailureCode::InvalidRequest,
        FailureCode::IntegrityViolation,
        FailureCode::TargetRejected,
        FailureCode::TargetUnavailable,
        FailureCode::UnexpectedFailure,
        FailureCode::LeaseExpired,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FailureCode::InvalidRequest => "invalid_request",
            FailureCode::IntegrityViolation => "integrity_violation",
            FailureCode::TargetRejected => "target_rejected",
            FailureCode::TargetUnavailable => "target_unavailable",
            FailureCode::UnexpectedFailure => "unexpected_failure",
            FailureCode::LeaseExpired => "lease_expired",
        }
    }

    pub fn is_retryable(self) -> bool {
        matches!(self, FailureCode::TargetUnavailable | FailureCode::UnexpectedFailure)
    }

    /// Classifies a handler's SQLSTATE (five characters) by its class, so that only the code,
    /// never the error text, is recorded.
    pub fn from_sqlstate(sqlstate: &str) -> FailureCode {
        match sqlstate {
            "55P03" | "57014" => FailureCode::TargetUnavailable,
            "42501" => FailureCode::TargetRejected,
            _ => match &sqlstate[..2.min(sqlstate.len())] {
                "22" => FailureCode::InvalidRequest,
                "23" => FailureCode::IntegrityViolation,
                // Syntax or access rule violations, invalid authorization, transaction control
                // in a handler, program limits (stack depth, sizes): a retry cannot succeed.
                "42" | "28" | "2D" | "54" => FailureCode::TargetRejected,
                "40" | "53" | "08" => FailureCode::TargetUnavailable,
                _ => FailureCode::UnexpectedFailure,
            },
        }
    }

    /// Parses a code given to `fail_durable_job`; anything else is bad input (22023).
    pub fn from_caller(code: &str) -> FailureCode {
        match Self::ALL.iter().find(|c| c.as_str() == code) {
            Some(FailureCode::LeaseExpired) => {
                invalid("failure_code lease_expired is set by claims only and cannot be reported")
            }
            Some(found) => *found,
            None => invalid(
                "unknown failure_code: expected one of invalid_request, integrity_violation, \
                 target_rejected, target_unavailable, unexpected_failure",
            ),
        }
    }
}
